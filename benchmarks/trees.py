"""What a draft *tree* would give per target pass, replayed greedily: the next lever, measured first.

    python -m benchmarks.trees [--draft demo-draft] [--datasets humaneval,mtbench] [--num-prompts 8]
        [--max-tokens 64] [--nodes 4,8,16,32] [--k 4,8] [--answers ACCEPTANCE_JSON]

Greedy speculation verifies a chain: K drafts, each the draft's top token after the one before.
A tree (SpecInfer, Medusa, Sequoia, EAGLE-2) spends the pass on several continuations at once:
the target scores every node in one forward under a tree attention mask, and the window keeps
the longest root path the target agrees with. Where a pass over tens of tokens costs about one
over a few (a GPU), a wide tree pays where the chain's acceptance is low (MT-Bench); on a CPU the
pass cost grows with its tokens, and the measured costs below say how wide a tree still pays.
Nothing in mirrorspec verifies trees yet; this replay says what one would buy before it is built.

Along the target's own greedy answer (teacher-forced, as ``benchmarks.acceptance`` replays), the
rank of the answer's token in the draft's distribution at every position is all a greedy replay
needs. A static tree is a prefix-closed set of *rank paths*: node (0, 1) is the draft's
runner-up after its own top token. A window starting at position s accepts the longest prefix
of (rank[s], rank[s+1], ...) that is a node, then the target adds one token; teacher forcing is
exact along that path, because its tokens are the answer's. The chain of K is the tree
{(0,), (0, 0), ...}, and its replay is ``benchmarks.acceptance.replay_greedy``'s.

Trees of N nodes are fitted (Sequoia's construction: the N nodes the answers pass through most
often, each with its parent) on the even-numbered prompts of all datasets and replayed on the
odd-numbered ones, so no tree is scored on the answers it was built from. Costs are measured, in
one-token target steps: the target pass over N + 1 tokens, and drafting the tree as one batched
draft forward per depth (a tree attention mask's own overhead is not included). ``est.x`` is
tokens per pass over the cost of a pass plus its drafting: an estimate for an engine that does
not exist yet, not a timing.
"""

from __future__ import annotations

import argparse
import heapq
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.acceptance import replay_greedy, teacher_forced_logits
from benchmarks.flags import add_run_flags, csv_of, draft_spec, positive, torch_threads, window_k
from benchmarks.pass_cost import measure
from benchmarks.prompts import add_replay_flags, load_prompts
from benchmarks.run import load_draft
from mirrorspec.config import DEFAULT_DRAFT_QUANTIZE, InvalidRequest, SamplingParams
from mirrorspec.drafting.draft_model import DraftModelDrafter
from mirrorspec.engine import generate
from mirrorspec.models import LoadedModel, encode_prompt, load_causal_lm

OUTSIDE = 1 << 30  # the rank of a token outside the draft's sub-vocabulary: in no tree
RankPath = tuple[int, ...]


def answer_ranks(drafter: DraftModelDrafter, prompt: list[int], answer: list[int]) -> list[int]:
    """The rank of each answer token among the draft's logits there, teacher-forced (0: the
    draft's own greedy choice; ``OUTSIDE``: a token outside its sub-vocabulary)."""
    if not answer:
        return []
    logits = teacher_forced_logits(drafter, prompt, answer)  # [n, vocab]
    chosen = logits.gather(1, torch.tensor(answer, device=logits.device)[:, None])  # [n, 1]
    ranks = (logits > chosen).sum(-1)  # [n]
    return torch.where(chosen[:, 0] == float("-inf"), OUTSIDE, ranks).tolist()


def chain(k: int) -> frozenset[RankPath]:
    return frozenset((0,) * d for d in range(1, k + 1))


def fit_tree(ranks: Sequence[Sequence[int]], nodes: int, depth: int) -> frozenset[RankPath]:
    """The ``nodes`` rank paths that the answers' windows pass through most often, prefix-closed.

    A node's count never exceeds its parent's, so taking the best child of the tree so far, one
    at a time, gives the most tokens per pass a static tree of this size can give on these answers."""
    counts: Counter[RankPath] = Counter()
    for answer in ranks:
        for start in range(len(answer)):
            path = tuple(answer[start:start + depth])
            for d in range(1, len(path) + 1):
                if path[d - 1] == OUTSIDE:
                    break
                counts[path[:d]] += 1
    children: dict[RankPath, list[RankPath]] = {}
    for node in counts:
        children.setdefault(node[:-1], []).append(node)
    tree: set[RankPath] = set()
    frontier = [(-counts[c], len(c), c) for c in children.get((), [])]  # ties: shallower, then lower ranks
    heapq.heapify(frontier)
    while frontier and len(tree) < nodes:
        *_, node = heapq.heappop(frontier)
        tree.add(node)
        for child in children.get(node, []):
            heapq.heappush(frontier, (-counts[child], len(child), child))
    return frozenset(tree)


@dataclass(frozen=True)
class TreeReplay:
    passes: int
    tokens: int

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / max(self.passes, 1)


def replay_tree(ranks: Sequence[int], tree: frozenset[RankPath]) -> TreeReplay:
    """The windows greedy tree speculation runs along one answer: each keeps the longest node
    prefix of the ranks from its start, then the target's own token. The last window reaches no
    further than the answer's end."""
    start = passes = 0
    depth = max((len(node) for node in tree), default=0)
    while start < len(ranks):
        budget = min(depth, len(ranks) - start - 1)
        accepted = 0
        while accepted < budget and tuple(ranks[start:start + accepted + 1]) in tree:
            accepted += 1
        passes += 1
        start += accepted + 1
    return TreeReplay(passes, len(ranks))


def widths(tree: frozenset[RankPath]) -> list[int]:
    """Nodes per depth: what each batched draft forward carries."""
    counts = Counter(len(node) for node in tree)
    return [counts[d] for d in range(1, max(counts, default=0) + 1)]


@dataclass
class Row:
    dataset: str
    shape: str  # "chain K=4" or "tree N=16"
    nodes: int
    depth: int
    widths: list[int]
    tokens_per_pass: float
    verify_cost: float  # target pass over nodes + 1 tokens, in one-token target steps
    draft_cost: float  # drafting the tree, one batched draft forward per depth, in target steps
    est_speedup: float


def rows_for(dataset: str, shape: str, tree: frozenset[RankPath], held_out: Sequence[Sequence[int]],
             target_cost: dict[int, float], draft_cost: dict[int, float]) -> Row:
    replays = [replay_tree(r, tree) for r in held_out]
    per_pass = sum(r.tokens for r in replays) / max(sum(r.passes for r in replays), 1)
    per_depth = widths(tree)
    drafting = sum(draft_cost[w] for w in per_depth)
    verify = target_cost[len(tree)]
    return Row(dataset, shape, len(tree), len(per_depth), per_depth, round(per_pass, 3), round(verify, 3),
               round(drafting, 3), round(per_pass / (verify + drafting), 3))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trees", description=__doc__.split("\n")[0])
    add_replay_flags(p)
    p.add_argument("--nodes", type=csv_of(positive), default=[4, 8, 16, 32], help="tree sizes (default 4,8,16,32)")
    p.add_argument("--depth", type=positive, default=8, help="deepest node a tree may have (default 8)")
    p.add_argument("--k", type=csv_of(window_k), default=[4, 8], help="chains to compare with (default 4,8)")
    add_run_flags(p)
    p.add_argument("--draft", type=draft_spec, default="demo-draft",
                   help="demo-draft (default), demo-draft weights, or a model path sharing the target's tokenizer")
    p.add_argument("--answers", type=Path, default=None,
                   help="reuse the target answers of a benchmarks.acceptance JSON (same target, prompts and "
                        "--max-tokens) instead of generating them")
    p.add_argument("--reps", type=positive, default=15, help="timing repetitions per pass size (default 15)")
    return p


def stored_answers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, dict[str, list[int]]]:
    """``--answers``: {dataset: {prompt id: answer ids}} from a benchmarks.acceptance JSON, checked
    against this run's flags before any model loads; empty without the flag."""
    if args.answers is None:
        return {}
    try:
        run = json.loads(args.answers.read_text())
        made_with = {key: run["config"].get(key) for key in ("max_tokens", "target")}
        kept = {d: {r["prompt_id"]: r["answer_ids"] for r in records} for d, records in run["answers"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        parser.error(f"argument --answers: {args.answers} is not a benchmarks.acceptance JSON ({err!r})")
    for flag, key in (("--max-tokens", "max_tokens"), ("--target", "target")):
        if made_with[key] != getattr(args, key):
            parser.error(f"argument --answers: {args.answers} holds answers made with {flag} {made_with[key]}, "
                         f"not {getattr(args, key)}; pass the same {flag} or drop --answers")
    for dataset in args.datasets:
        if any(p.prompt_id not in kept.get(dataset, {}) for p in load_prompts(dataset, args.num_prompts)):
            parser.error(f"argument --answers: {args.answers} lacks some of the first {args.num_prompts} "
                         f"{dataset} prompts; pass fewer --num-prompts or drop --answers")
    return kept


def target_answers(target: LoadedModel, args: argparse.Namespace,
                   stored: dict[str, dict[str, list[int]]]) -> dict[str, list[tuple[list[int], list[int]]]]:
    """(prompt ids, greedy answer ids) per dataset: from ``stored`` where given, else generated."""
    params = SamplingParams(max_new_tokens=args.max_tokens, stop_token_ids=target.stop_token_ids())
    out: dict[str, list[tuple[list[int], list[int]]]] = {}
    for dataset in args.datasets:
        pairs = []
        for prompt in tqdm(load_prompts(dataset, args.num_prompts), desc=f"target answers, {dataset}",
                           disable=args.no_progress):
            ids = encode_prompt(target.tokenizer, prompt.text)
            answer = (stored[dataset][prompt.prompt_id] if stored
                      else list(generate(target.model, None, ids, params).token_ids))
            pairs.append((ids, answer))
        out[dataset] = pairs
    return out


def format_table(rows: list[Row]) -> str:
    head = f"{'dataset':10} {'shape':12} {'nodes':>5} {'depth':>5} {'tok/pass':>8} {'verify':>7} {'draft':>6} {'est.x':>6}  widths"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.dataset:10} {r.shape:12} {r.nodes:5d} {r.depth:5d} {r.tokens_per_pass:8.2f} "
                     f"{r.verify_cost:7.2f} {r.draft_cost:6.2f} {r.est_speedup:6.2f}  {r.widths}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with torch_threads(args.threads), torch.inference_mode():
        return _run(args, parser)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    stored = stored_answers(args, parser)
    try:
        target = load_causal_lm(args.target)
        draft = load_draft(args.draft, target, [DEFAULT_DRAFT_QUANTIZE]).model
    except (InvalidRequest, OSError, ValueError) as err:
        parser.error(f"--target/--draft: {err}")
    if draft is None:
        parser.error("--draft: name a draft model; a tree is drafted by one")
    answers = target_answers(target, args, stored)
    drafter = DraftModelDrafter(draft)
    ranks = {d: [answer_ranks(drafter, ids, answer) for ids, answer in pairs] for d, pairs in answers.items()}
    fitted_on = [r for per in ranks.values() for r in per[0::2]]
    trees = {f"tree N={n}": fit_tree(fitted_on, n, args.depth) for n in args.nodes}
    shapes = {f"chain K={k}": chain(k) for k in args.k} | trees
    largest = max(len(t) for t in shapes.values())
    context = next(iter(answers.values()))[0][0]
    target_steps = measure(target.model, context, largest, args.reps)  # {n drafts: seconds}
    draft_steps = measure(draft, context, largest, args.reps, drafter.vocab_ids)  # as the drafter runs it
    target_cost = {n: target_steps[n] / target_steps[0] for n in target_steps}
    draft_cost = {w: draft_steps[w - 1] / target_steps[0] for w in range(1, largest + 1)}
    rows = [rows_for(dataset, name, tree, per[1::2], target_cost, draft_cost)
            for dataset, per in ranks.items() for name, tree in shapes.items()]
    print(format_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"trees-{time.strftime('%Y%m%d-%H%M%S')}.json"
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path.write_text(json.dumps({"config": config, "rows": [asdict(r) for r in rows],
                                "trees": {name: sorted(tree) for name, tree in trees.items()},
                                "chain_check": chain_check(ranks, args.k)}, indent=1))
    print(f"\nwrote {path}")
    return 0


def chain_check(ranks: dict[str, list[list[int]]], ks: Sequence[int]) -> dict[str, bool]:
    """Per dataset and K, whether the chain's tree replay equals ``replay_greedy``'s windows."""
    out = {}
    for dataset, per in ranks.items():
        for k in ks:
            same = all(replay_tree(r, chain(k)).passes == replay_greedy([x == 0 for x in r], k).windows for r in per)
            out[f"{dataset} K={k}"] = same
    return out


if __name__ == "__main__":
    raise SystemExit(main())
