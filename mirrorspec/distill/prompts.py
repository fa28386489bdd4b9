"""Training prompts for the demo draft, built from what every Python install carries.

The draft must learn what the *target* says, so the prompts only have to be the kind of thing
users ask; the answers are written by the target itself (``teacher.py``). They come from local,
deterministic sources and never from the benchmark sets (MT-Bench, HumanEval), which would make
the reported acceptance rates meaningless:

* code completion: signature + docstring of functions in Python's own standard library, asked
  for exactly as the benchmark asks for HumanEval stubs;
* code editing: short, unannotated stdlib functions, "add type hints";
* chat: templates over topics in the spirit of MT-Bench's categories (writing, roleplay,
  reasoning, math, coding, extraction, STEM, humanities), plus passages of Python's own
  documentation (``pydoc_data``) to explain or summarise. Prompt set 2 draws the chat from
  ``broad_chat``, a much wider family of phrasings, subjects and constraints.

The order is a seeded shuffle, so "the first N prompts" is a reproducible training set.
"""

from __future__ import annotations

import ast
import functools
import random
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mirrorspec.distill.broad_chat import broad_chat_prompts

# The benchmark's own phrasings, so the draft sees the same instruction the benchmark sends.
COMPLETE_INSTRUCTION = "Complete this Python function:\n\n"
EDIT_INSTRUCTION = "Add type hints to this function:\n\n"


@dataclass(frozen=True)
class TrainingPrompt:
    kind: str  # "complete" | "edit" | "chat" | "docs"
    text: str


class PromptsRanOut(ValueError):
    """A teacher budget asks for more distinct prompts than the prompt set holds."""


def stdlib_functions(max_lines: int = 30) -> Iterator[ast.FunctionDef]:
    """Documented functions (and methods) of the standard library, parsed, never imported."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "idlelib", "tkinter", "lib2to3", "site-packages", "turtledemo", "ensurepip")
    for path in sorted(root.rglob("*.py")):
        if any(part in skip for part in path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node):
                if node.end_lineno - node.lineno < max_lines:
                    yield node


def completion_stub(fn: ast.FunctionDef) -> str:
    """``def name(args):`` and its docstring, as a HumanEval stub looks."""
    doc = textwrap.indent(ast.get_docstring(fn).strip(), "    ")
    returns = f" -> {ast.unparse(fn.returns)}" if fn.returns else ""
    return f'def {fn.name}({ast.unparse(fn.args)}){returns}:\n    """\n{doc}\n    """\n'


def edit_source(fn: ast.FunctionDef) -> str | None:
    """The whole function, for the type-hint task, when it has no annotations yet."""
    if fn.returns or any(a.annotation for a in fn.args.args):
        return None
    fn = ast.fix_missing_locations(fn)
    return ast.unparse(fn) + "\n"


_TOPICS = [
    "the water cycle", "black holes", "photosynthesis", "the French Revolution", "machine learning",
    "climate change", "the stock market", "vaccines", "the Roman Empire", "renewable energy",
    "quantum computing", "the human brain", "jazz music", "coffee", "remote work", "social media",
    "electric cars", "the Renaissance", "volcanoes", "honey bees", "the internet", "chess",
    "meditation", "the Moon landing", "inflation", "ancient Egypt", "recycling", "sleep",
    "DNA", "earthquakes", "the printing press", "public libraries", "time management", "bridges",
    "friendship", "democracy", "the Silk Road", "tea ceremonies", "marathon training", "origami",
    "cloud computing", "urban gardening", "the Industrial Revolution", "rainforests", "video games",
    "supply chains", "the immune system", "space telescopes", "minimalism", "public speaking",
    "Shakespeare", "the Olympic Games", "cryptography", "coral reefs", "nuclear power", "museums",
    "learning a new language", "the history of money", "artificial intelligence ethics", "tides",
]
_PEOPLE = [
    "a pirate captain", "a medieval knight", "a detective", "a tour guide in Rome", "a chef",
    "a startup founder", "a high-school teacher", "a space station engineer", "a librarian",
    "a sports commentator", "a museum curator", "a marine biologist", "a travel blogger",
]
_CHAT_TEMPLATES = [
    # writing
    "Write a short blog post about {topic}.",
    "Compose an engaging travel blog post about a trip that involved {topic}.",
    "Write a persuasive email to a friend convincing them to learn about {topic}.",
    "Draft a professional email asking a colleague for feedback on a report about {topic}.",
    "Write a short poem about {topic}.",
    "Write a 200-word story in which {topic} plays a central role.",
    "Describe {topic} in vivid, sensory language.",
    # roleplay
    "Pretend you are {person}. Explain {topic} to a curious visitor.",
    "Act as {person} and give three tips about {topic}.",
    "You are {person}. Describe your typical day, and mention {topic}.",
    # reasoning and math
    "If a train travels {a} km in {b} hours, what is its average speed? Explain your reasoning.",
    "Solve for x: {a}x + {b} = {c}. Show your steps.",
    "A shop sells pens at {a} cents each. How much do {b} pens cost? Explain.",
    "What is the sum of the integers from 1 to {a}? Explain how you computed it.",
    "I have {a} apples and give away {b}. Then I buy {c} more. How many do I have now?",
    "Is {a} a prime number? Explain step by step.",
    # coding
    "Write a Python function that {task}.",
    "Explain, with a short code example, how to {task} in Python.",
    "Write a C++ function that {task}.",
    # STEM and humanities
    "Explain {topic} to a ten-year-old.",
    "What are the main advantages and disadvantages of {topic}?",
    "Give a brief history of {topic}.",
    "What are three common misconceptions about {topic}?",
    "How does {topic} affect everyday life? Give examples.",
    "Compare {topic} and {topic2}: how are they similar and how do they differ?",
    # extraction
    "List five key facts about {topic} as bullet points.",
    "Summarize the most important ideas about {topic} in three sentences.",
]
_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the vowels in a sentence",
    "returns the n-th Fibonacci number", "merges two sorted lists", "removes duplicates from a list",
    "finds the longest word in a sentence", "computes the factorial of n", "flattens a nested list",
    "checks whether a string is a palindrome", "converts Celsius to Fahrenheit", "sorts a dictionary by value",
    "finds the second largest number in a list", "reads a CSV file and sums a column",
    "counts word frequencies in a text", "computes the greatest common divisor of two numbers",
    "validates an email address with a regular expression", "implements binary search",
    "transposes a matrix", "groups a list of words by their first letter", "rotates a list by k positions",
    "returns all permutations of a string", "parses a date string into a datetime",
    "computes the median of a list", "implements a simple stack class",
]
_DOC_TEMPLATES = [
    "Explain the following part of the Python documentation in plain words:\n\n{passage}",
    "Summarize this passage from the Python reference in a few sentences:\n\n{passage}",
    "Give a short example that illustrates this passage:\n\n{passage}",
]


def chat_prompts(rng: random.Random, n: int) -> list[TrainingPrompt]:
    out = []
    for _ in range(n):
        template = rng.choice(_CHAT_TEMPLATES)
        topic, topic2 = rng.sample(_TOPICS, 2)
        out.append(TrainingPrompt("chat", template.format(
            topic=topic, topic2=topic2, person=rng.choice(_PEOPLE), task=rng.choice(_TASKS),
            a=rng.randint(2, 120), b=rng.randint(2, 40), c=rng.randint(2, 300))))
    return out


def doc_prompts(rng: random.Random, max_chars: int = 900) -> list[TrainingPrompt]:
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        paragraphs = [p.strip() for p in topics[name].split("\n\n") if len(p.strip()) > 200]
        for passage in paragraphs[:3]:
            out.append(TrainingPrompt("docs", rng.choice(_DOC_TEMPLATES).format(passage=passage[:max_chars])))
    return out


@functools.cache
def code_prompts() -> tuple[TrainingPrompt, ...]:
    """Completion and editing prompts over the standard library (parsed once per process: seconds)."""
    prompts: list[TrainingPrompt] = []
    seen: set[str] = set()
    for fn in stdlib_functions():
        stub = completion_stub(fn)
        if stub not in seen:
            seen.add(stub)
            prompts.append(TrainingPrompt("complete", COMPLETE_INSTRUCTION + stub))
            source = edit_source(fn) if len(seen) % 3 == 0 else None  # editing is a third as common
            if source and len(source) < 1500:
                prompts.append(TrainingPrompt("edit", EDIT_INSTRUCTION + source))
    return tuple(prompts)


def training_prompts(seed: int = 0, num_chat: int = 6000, *, prompt_set: int,
                     count: int | None = None) -> list[TrainingPrompt]:
    """Every training prompt, in a seeded order; take the first N for a budgeted run.

    ``prompt_set`` (no default: `DistillRecipe.prompt_set` is the one place that picks it) 1 asks
    chat from the templates above; 2 from ``broad_chat``'s wider family.
    The code and documentation prompts are the same in both.

    The shuffled pool holds ~10.6k prompts. A ``count`` beyond it appends chat prompts drawn after
    it (``more_chat_prompts``), so a bigger teacher budget keeps every prompt, in place, of a
    smaller one and so reuses its cached teacher shards.
    """
    if prompt_set not in (1, 2):
        raise ValueError(f"prompt_set must be 1 or 2, got {prompt_set}")
    rng = random.Random(seed)
    prompts = list(code_prompts())
    prompts += _chat(rng, num_chat, prompt_set)
    prompts += doc_prompts(rng)
    rng.shuffle(prompts)
    if count is not None and count > len(prompts):
        prompts += more_chat_prompts(seed, count - len(prompts), prompt_set=prompt_set,
                                     exclude={p.text for p in prompts})
    return prompts


def _chat(rng: random.Random, n: int, prompt_set: int) -> list[TrainingPrompt]:
    if prompt_set == 1:
        return chat_prompts(rng, n)
    return [TrainingPrompt("chat", text) for text in broad_chat_prompts(rng, n)]


def more_chat_prompts(seed: int, n: int, *, prompt_set: int, exclude: set[str],
                      max_rounds: int = 64) -> list[TrainingPrompt]:
    """``n`` chat prompts past the pool, none in ``exclude``, from their own seeded generator.

    Chat only: the code prompts are a fixed list over the standard library, all already in the
    pool, and chat is where the draft agrees least with the target (MT-Bench).
    """
    rng = random.Random(f"more-chat-{seed}")
    seen = set(exclude)
    out: list[TrainingPrompt] = []
    for _ in range(max_rounds):
        asked = n - len(out)
        drawn = _chat(rng, asked, prompt_set)
        for prompt in drawn:
            if prompt.text not in seen:
                seen.add(prompt.text)
                out.append(prompt)
        if len(out) == n:
            return out
        if len(drawn) < asked:  # the family itself ran dry
            break
    raise PromptsRanOut(f"prompt set {prompt_set} ran out of distinct chat prompts after {len(out)} more "
                        f"({len(exclude) + len(out)} in all); lower the teacher budget")
