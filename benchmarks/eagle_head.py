"""Would a feature-conditioned (EAGLE) head beat the plain demo draft? Trained and replayed, no clock.

    python -m benchmarks.eagle_head train --prompts 0:3072,10592:13664 --epochs 4 --out head.safetensors
    python -m benchmarks.eagle_head replay --head head.safetensors [--datasets mtbench,humaneval]
        [--num-prompts 80] [--max-tokens 64] [--k 4,8]

``train`` has the demo target write answers to training prompts (``mirrorspec.distill.prompts``,
never the benchmark's), keeping its top-layer feature at every position
(``write_teacher_data(features=True)``; cached and resumable like the demo draft's teacher
stage), and trains ``mirrorspec.distill.eagle.EagleHead`` on them over the shipped draft's
sub-vocabulary.

``replay`` runs greedy windows along the target's own greedy answer to each benchmark prompt, as
``benchmarks.acceptance`` does for the plain draft, side by side with it on the same answers: the
head drafts each window by ``draft_chain`` (its first step from the target's true feature, later
steps from its own predictions), so unlike a plain draft its agreement depends on the depth in
the window, which the replay reports. It answers the demo-draft issue's question (alpha >= 0.55
on MT-Bench and HumanEval) for the head before any of the serving path is built for it. The first
window of each answer is drafted as if the prompt's features were known; a drafter would get them
from the prefill.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.acceptance import Replay, replay_greedy, teacher_forced_logits
from benchmarks.flags import (DEFAULT_OUT, csv_of, output_dir, positive, positive_float, thread_count, torch_threads,
                              window_k)
from benchmarks.prompts import add_replay_flags, load_prompts
from benchmarks.run import args_config, load_draft
from mirrorspec.config import SamplingParams
from mirrorspec.distill.eagle import (EagleHead, EagleRecipe, agreement, draft_chain, load_feature_examples,
                                      train_head)
from mirrorspec.drafting.draft_model import DraftModelDrafter
from mirrorspec.engine import generate
from mirrorspec.models import LoadedModel, encode_prompt, load_causal_lm
from mirrorspec.models.demo_draft import shipped_vocabulary


def replay_head(head: EagleHead, features: torch.Tensor, sequence: torch.Tensor, prompt_length: int,
                k: int) -> tuple[Replay, list[int], list[int]]:
    """Greedy windows of at most K head drafts along ``sequence`` (prompt + answer), the windows
    ``replay_greedy`` runs for a plain draft; and, per depth in the window, drafts tested and
    accepted there."""
    from transformers import DynamicCache

    answer = sequence[prompt_length:].tolist()
    cache, fed = DynamicCache(), 0
    start = tests = accepted_total = 0
    window_drafts: list[int] = []
    tested, kept = [0] * k, [0] * k
    while start < len(answer):
        budget = min(k, len(answer) - start - 1) if prompt_length + start >= 2 else 0  # a feature to start from
        drafts: list[int] = []
        if budget > 0:
            drafts, fed = draft_chain(head, features, sequence, prompt_length + start, budget, cache, fed)
        hits = 0
        for depth, token in enumerate(drafts):
            tested[depth] += 1
            if token != answer[start + depth]:
                break
            kept[depth] += 1
            hits += 1
        window_drafts.append(len(drafts))
        accepted_total += hits
        tests += hits + (hits < len(drafts))
        start += hits + 1
    return Replay(len(window_drafts), sum(window_drafts), accepted_total, tests, tuple(window_drafts)), tested, kept


def _summary(name: str, dataset: str, k: int, replays: Sequence[Replay], positions: int,
             tested: Sequence[int] = (), kept: Sequence[int] = ()) -> dict:
    windows, drafted, accepted, tests = Replay.totals(replays)
    return {"dataset": dataset, "draft": name, "k": k, "positions": positions,
            "accept": round(accepted / max(drafted, 1), 4), "alpha": round(accepted / max(tests, 1), 4),
            "tokens_per_pass": round(positions / max(windows, 1), 3),
            "by_depth": [round(b / a, 3) if a else None for a, b in zip(tested, kept)]}


def replay(args: argparse.Namespace) -> int:
    target = load_causal_lm(args.target)
    head = load_head(target, args.head)
    draft = DraftModelDrafter(load_draft(args.compare, target, [args.draft_quantize]).model)
    params = SamplingParams(max_new_tokens=args.max_tokens, stop_token_ids=target.stop_token_ids())
    rows = []
    for dataset in args.datasets:
        prompts = load_prompts(dataset, args.num_prompts)
        head_replays: dict[int, list] = {k: [] for k in args.k}
        draft_replays: dict[int, list] = {k: [] for k in args.k}
        positions = 0
        for prompt in tqdm(prompts, desc=f"replaying on {dataset}", disable=args.no_progress):
            ids = encode_prompt(target.tokenizer, prompt.text)
            answer = list(generate(target.model, None, ids, params).token_ids)
            if not answer:
                continue
            positions += len(answer)
            sequence = torch.tensor(ids + answer)
            with torch.inference_mode():
                features = target.model.get_decoder()(
                    input_ids=sequence[None, :-1].to(target.model.device)).last_hidden_state[0]
            agrees = (teacher_forced_logits(draft, ids, answer).argmax(-1) == torch.tensor(answer)).tolist()
            for k in args.k:
                head_replays[k].append(replay_head(head, features, sequence, len(ids), k))
                draft_replays[k].append(replay_greedy(agrees, k))
        for k in args.k:
            tested = [sum(r[1][d] for r in head_replays[k]) for d in range(k)]
            kept = [sum(r[2][d] for r in head_replays[k]) for d in range(k)]
            rows.append(_summary(args.compare, dataset, k, draft_replays[k], positions))
            rows.append(_summary(str(args.head), dataset, k, [r[0] for r in head_replays[k]], positions, tested, kept))
    print(f"{'dataset':<10} {'draft':<28} {'K':>2} {'positions':>9} {'accept':>6} {'alpha':>6} {'tok/pass':>8}  by depth")
    for r in rows:
        depth = " ".join("-" if v is None else f"{v:.2f}" for v in r["by_depth"])
        print(f"{r['dataset']:<10} {Path(r['draft']).name[:28]:<28} {r['k']:>2} {r['positions']:>9} {r['accept']:>6.3f} "
              f"{r['alpha']:>6.3f} {r['tokens_per_pass']:>8.3f}  {depth}")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / time.strftime("eagle-head-%Y%m%d-%H%M%S.json")
    config = args_config(args)
    out.write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    print(f"\nalpha = accepted / tests run (a window stops at its first miss); by depth = share of drafts "
          f"accepted at each depth of the window, of those tested there\nwrote {out}")
    return 0


def load_head(target: LoadedModel, path: Path) -> EagleHead:
    from safetensors.torch import load_file

    state = load_file(str(path))
    layer_ids = {int(name.split(".")[2]) for name in state if name.startswith("body.layers.")}
    if not layer_ids or "vocab" not in state:
        raise SystemExit(f"--head {path}: not a head written by `python -m benchmarks.eagle_head train` "
                         "(no body.layers.* or vocab)")
    layers = 1 + max(layer_ids)
    head = EagleHead(target.model, state["vocab"], layers=layers)
    head.load_trained_state(state)
    return head.eval()


def existing_file(text: str) -> Path:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return Path(text)


def prompt_slices(text: str) -> list[range]:
    """'0:3072,10592:13664' -> the training prompts' indices, each slice start:end."""
    out = []
    for part in text.split(","):
        try:
            start, end = (int(x) for x in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected start:end slices like 0:3072,10592:13664, got {part!r}")
        if not 0 <= start < end:
            raise argparse.ArgumentTypeError(f"slice {part!r} must have 0 <= start < end")
        out.append(range(start, end))
    return out


def train(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from mirrorspec.distill.prompts import training_prompts
    from mirrorspec.distill.teacher import write_teacher_data
    from mirrorspec.models.demo_target import cache_root

    args.out.parent.mkdir(parents=True, exist_ok=True)  # before the hour of work, not after
    chosen = [i for r in args.prompts for i in r]
    target = load_causal_lm("demo-target", dtype="bfloat16", prepack=False)
    pool = training_prompts(0, prompt_set=2, count=max(chosen) + 1)
    encoded = [encode_prompt(target.tokenizer, pool[i].text)[-args.max_prompt_tokens:] for i in chosen]
    # every setting that shapes the shards names them, so a cached run is never another's
    key = (f"eagle-teacher-{'_'.join(f'{r.start}-{r.stop}' for r in args.prompts)}"
           f"-p{args.max_prompt_tokens}-b{args.batch_size}")
    shards = write_teacher_data(target.model, encoded, cache_root() / "distill" / key, batch_size=args.batch_size,
                                max_new_tokens=128, stop_ids=target.stop_token_ids(), top_k=1, seed=0,
                                features=True, on_progress=lambda done, tokens: print(
                                    f"teacher batch {done}: {tokens} tokens", file=sys.stderr, flush=True))
    examples = [e for e in load_feature_examples(shards) if len(e.tokens) - e.start >= 3]
    held_out = examples[::40]
    train_set = [e for i, e in enumerate(examples) if i % 40]
    student_target = load_causal_lm("demo-target", dtype="float32", prepack=False, tokenizer=False)
    head = EagleHead(student_target.model, shipped_vocabulary(), layers=args.layers)
    recipe = EagleRecipe(epochs=args.epochs, layers=args.layers)
    with tqdm(desc="training the head", unit="step", disable=args.no_progress) as bar:
        def step(done: int, total: int, loss: float, match: float) -> None:
            bar.total = total
            bar.update(done - bar.n)
            bar.set_postfix(loss=f"{loss:.3f}", top1=f"{match:.2f}")
        train_head(head, train_set, recipe, on_step=step)
    save_file(head.trained_state(), str(args.out))
    print(f"held-out first-draft agreement {agreement(head, held_out):.4f} ({len(held_out)} sequences); "
          f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.eagle_head", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="target-written data with features, then the head")
    t.add_argument("--prompts", type=prompt_slices, required=True,
                   help="training prompt indices as start:end slices (mirrorspec.distill.prompts, prompt set 2)")
    t.add_argument("--epochs", type=positive_float, default=EagleRecipe.epochs)
    t.add_argument("--layers", type=positive, default=EagleRecipe.layers)
    t.add_argument("--batch-size", type=positive, default=64, help="teacher prompts per batch (default 64)")
    t.add_argument("--max-prompt-tokens", type=positive, default=384)
    t.add_argument("--out", type=Path, required=True, help="the head's weights (.safetensors)")
    r = sub.add_parser("replay", help="greedy windows along the target's answers, beside the plain draft")
    add_replay_flags(r)
    r.add_argument("--head", type=existing_file, required=True, help="weights written by `train`")
    r.add_argument("--compare", default="demo-draft", help="the plain draft replayed beside it (default demo-draft)")
    r.add_argument("--draft-quantize", default="int8", choices=("int8", "none"))
    r.add_argument("--k", type=csv_of(window_k), default=[4, 8])
    r.add_argument("--target", default="demo-target")
    r.add_argument("--out", type=output_dir, default=DEFAULT_OUT)
    for sp in (t, r):
        sp.add_argument("--threads", type=thread_count, default=2, help="torch intra-op threads (default 2)")
        sp.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with torch_threads(args.threads):
        return train(args) if args.command == "train" else replay(args)


if __name__ == "__main__":
    sys.exit(main())
