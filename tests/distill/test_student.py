import torch
from transformers import AutoModelForCausalLM

from mirrorspec.config import DistillRecipe
from mirrorspec.distill.student import (
    agreement,
    assemble_draft,
    choose_draft_vocabulary,
    distill,
    init_student,
    load_examples,
    save_draft_weights,
)
from mirrorspec.distill.teacher import write_teacher_data
from mirrorspec.drafting.draft_model import DRAFT_VOCAB_KEY


def teacher_examples(target, tmp_path, n=48):
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 16, (4,), generator=generator).tolist() for _ in range(n)]
    shards = write_teacher_data(target, prompts, tmp_path / "teacher", batch_size=8, max_new_tokens=8,
                                stop_ids=[], top_k=8, seed=0)
    return load_examples(shards)


def test_vocabulary_is_the_targets_most_frequent_choices_plus_required_ids(tiny_dir, tmp_path):
    import support

    examples = teacher_examples(support.load(tiny_dir["target16"]), tmp_path)
    vocab = choose_draft_vocabulary(examples, size=5, vocab_size=16, always=[15])
    counts = torch.bincount(torch.cat([e.top_ids[:, 0] for e in examples]), minlength=16)
    assert 15 in vocab and len(vocab) == 5 and vocab == sorted(vocab)
    others = [i for i in vocab if i != 15]
    assert min(counts[others]) >= max(counts[[i for i in range(15) if i not in vocab]])


def test_distillation_raises_agreement_with_the_target(tiny_dir, tmp_path):
    import support

    target = support.load(tiny_dir["target16"])
    examples = teacher_examples(target, tmp_path)
    vocab = choose_draft_vocabulary(examples, size=12, vocab_size=16)
    student = init_student(target, layers=1)
    before = agreement(student, vocab, examples)
    recipe = DistillRecipe(epochs=30, batch_sequences=8, learning_rate=3e-3)
    losses = []
    distill(student, vocab, examples, recipe, on_step=lambda step, total, loss, match: losses.append(loss))
    after = agreement(student, vocab, examples)
    assert after > before + 0.1, (before, after)
    assert sum(losses[-5:]) < sum(losses[:5])
    # only the layers and norm were trained: the target's embedding and head are untouched
    assert torch.equal(student.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(student.lm_head.weight, target.lm_head.weight)


def test_the_student_trains_on_transformers_sdpa_whatever_the_target_runs(tiny_dir):
    """A target loaded for serving runs mirrorspec_sdpa on CPU: its logits match sdpa's bit for
    bit but its gradients round differently, and the shipped draft was trained on sdpa."""
    from mirrorspec.models import load_causal_lm
    from mirrorspec.models.attention import IMPLEMENTATION

    target = load_causal_lm(str(tiny_dir["target16"]), tokenizer=False, prepack=False).model
    assert target.config._attn_implementation == IMPLEMENTATION
    assert init_student(target, layers=1).config._attn_implementation == "sdpa"


def test_shipped_weights_reassemble_into_a_plain_checkpoint(tiny_dir, tmp_path):
    import support

    target = support.load(tiny_dir["target16"])
    student = init_student(target, layers=1)
    with torch.no_grad():
        student.model.layers[0].mlp.down_proj.weight.add_(0.5)  # something the target does not have
    vocab = [0, 2, 3, 5, 7, 11, 13]
    save_draft_weights(student, vocab, tmp_path / "draft.safetensors")
    assemble_draft(target, tmp_path / "draft.safetensors", tmp_path / "draft")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "draft", dtype=torch.float32).eval()
    assert getattr(loaded.config, DRAFT_VOCAB_KEY) == vocab
    ids = torch.tensor([[0, 3, 5, 2, 9]])
    with torch.inference_mode():
        # shipped in bfloat16, so equal to bf16 rounding of the trained weights
        assert torch.allclose(loaded(ids).logits, student(ids).logits, atol=0.05)
        assert torch.equal(loaded.model.embed_tokens.weight, target.model.embed_tokens.weight)
