"""Self-generated training prompts: the target writes the user requests it is then trained on.

``selfchat``: for one of MT-Bench's eight categories (writing, roleplay, reasoning, math, coding,
extraction, stem, humanities) and a topic from a fixed list, the target continues a short
few-shot list ("Topic: ... / Request: ...", two hand-written examples of the category, raw text,
T = 1, top-p 0.95) with a request about the new topic; about half of the kept requests get a
generic, category-specific follow-up as a second user turn (MT-Bench style). ``selfmath``: a
grade-school word problem written the same way, wrapped in the GSM8K instruction
(``flashspec.data.format_gsm8k``), the eval prompts' exact format. ``selfcode``: a Python
signature with a docstring and doctests, in the HumanEval prompt format
(``flashspec.data.format_humaneval``).

Kept texts are cleaned, deduplicated and checked against every prompt of the real prompt sets
(both splits) and the shown examples: none can equal an eval prompt. The prompts (category,
topic, examples shown) and their provenance are cached as JSON under ``<cache_root>/prompts/``,
keyed by (name, n, seed, target, version).
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from flashspec.data import DATASETS, Prompt, all_prompts, format_gsm8k, format_humaneval
from flashspec.errors import FlashSpecError

log = logging.getLogger(__name__)
SYNTH_DATASETS = ("selfchat", "selfmath", "selfcode")
VERSION = "flashspec-synth-v1"
OVERSAMPLE = 1.3                   # requests written per prompt wanted (some are filtered out)
REQUEST_TOKENS = {"selfchat": 80, "selfmath": 80, "selfcode": 128}
REQUEST_SAMPLING = (1.0, 0, 0.95)  # temperature, top_k, top_p of the request writer
FOLLOWUP_FRACTION = 0.5

TOPICS: dict[str, list[str]] = {  # MT-Bench's eight categories, a few topics each
    "writing": ["a job application", "a birthday party", "a trip to Japan", "climate change",
                "a new smartphone", "a lost cat", "friendship", "a product launch",
                "moving to a new city", "a school play", "a restaurant review", "the ocean",
                "a thank-you note", "a complaint to a landlord", "a wedding speech", "autumn",
                "a startup pitch", "volunteering", "a museum visit", "the future"],
    "roleplay": ["a pirate captain", "a travel agent", "a doctor", "a medieval knight",
                 "a detective", "a personal trainer", "a chef", "a job interviewer",
                 "Sherlock Holmes", "a tour guide in Rome", "a startup founder", "a teacher",
                 "a customer support agent", "a time traveler", "a wizard", "a lawyer",
                 "an astronaut", "a poet", "a car salesman", "a psychologist"],
    "reasoning": ["family relations", "ordering people in a line", "days of the week",
                  "truth-tellers and liars", "ages of siblings", "a race", "coins",
                  "seating around a table", "clocks", "colored balls in a bag", "a river crossing",
                  "heights of friends", "cause and effect", "directions on a map", "a tournament",
                  "calendars"],
    "math": ["fractions", "percentages", "probability", "geometry", "algebra", "prime numbers",
             "sequences", "areas and volumes", "simple interest", "equations", "statistics",
             "ratios", "triangles", "combinatorics", "derivatives", "integrals"],
    "coding": ["Python lists", "sorting algorithms", "string manipulation", "recursion",
               "SQL queries", "JavaScript", "binary search", "linked lists", "file handling",
               "regular expressions", "dictionaries", "dynamic programming", "C++ classes",
               "unit testing", "graphs", "web APIs", "bash scripts", "matrices"],
    "extraction": ["a news article", "a product description", "a meeting note", "a list of books",
                   "customer reviews", "a recipe", "a movie plot", "a company report", "an email",
                   "a travel itinerary", "sports results", "a scientific abstract",
                   "a job posting", "weather reports"],
    "stem": ["photosynthesis", "black holes", "vaccines", "electric circuits", "DNA",
             "machine learning", "quantum physics", "plate tectonics", "batteries",
             "the immune system", "chemical reactions", "renewable energy", "gravity",
             "the internet", "semiconductors", "evolution", "nuclear fusion", "sound waves"],
    "humanities": ["the Roman Empire", "inflation", "Shakespeare", "democracy", "the Renaissance",
                   "ethics", "World War II", "supply and demand", "impressionism",
                   "the French Revolution", "human rights", "globalization", "ancient Egypt",
                   "music history", "Stoicism", "the Industrial Revolution", "copyright law",
                   "mythology"],
}
# Hand-written few-shot examples (topic, request), none taken from a prompt set: a 135M model
# writes far better requests by continuing a "Topic: / Request:" list than when asked to.
EXAMPLES: dict[str, list[tuple[str, str]]] = {
    "writing": [
        ("a rainy afternoon", "Write a short poem about a rainy afternoon in the city."),
        ("a team meeting", "Draft a polite email to my team moving our weekly meeting to "
                           "Thursday."),
        ("a first job", "Write a blog post with five tips for someone starting their first "
                        "office job.")],
    "roleplay": [
        ("a ship captain", "Pretend you are the captain of a cargo ship caught in a storm. Tell "
                           "your crew what to do."),
        ("a barista", "Act as a friendly barista and help me choose a drink for a cold morning."),
        ("a history teacher", "You are a history teacher. Explain to your class why the printing "
                              "press mattered, in your own style.")],
    "reasoning": [
        ("birthdays", "Anna is older than Ben, and Ben is older than Carl. Who is the youngest, "
                      "and how do you know?"),
        ("labels", "Three boxes are labeled apples, oranges and mixed, and every label is wrong. "
                   "How can you fix the labels by opening just one box?"),
        ("a schedule", "If today is Wednesday, what day will it be 100 days from now? Explain "
                       "your reasoning.")],
    "math": [
        ("circles", "What is the area of a circle with a radius of 7 cm?"),
        ("equations", "Solve for x: 3x + 7 = 25."),
        ("dice", "If I roll two dice, what is the probability that the sum is 8?")],
    "coding": [
        ("lists", "Write a Python function that removes duplicates from a list while keeping "
                  "the order."),
        ("SQL", "How do I select the five most recent orders from an orders table in SQL?"),
        ("strings", "Write a function that checks whether a string is a palindrome, ignoring "
                    "spaces and case.")],
    "extraction": [
        ("a product review", 'Extract the product name and the rating from this review: "I bought '
                             'the Aero 3 headphones last month. Great sound, weak battery. 4 out '
                             'of 5."'),
        ("a meeting note", 'List the action items from this note: "Maria sends the budget by '
                           'Friday. Tom books the venue. Everyone reviews the draft."'),
        ("a news story", 'Summarize this in one sentence: "The council approved a new bike lane '
                         'on Main Street after months of debate. Construction starts in May."')],
    "stem": [
        ("volcanoes", "Why do some volcanoes erupt explosively while others just ooze lava?"),
        ("computers", "How does a computer store numbers in binary?"),
        ("plants", "What role do roots play in keeping a plant alive?")],
    "humanities": [
        ("ancient Greece", "What were the main differences between Athens and Sparta?"),
        ("money", "Why do prices usually rise when the money supply grows quickly?"),
        ("novels", "What makes a novel a classic? Give a few examples.")],
}
LABELS = {"writing": "writing", "roleplay": "role-play", "reasoning": "reasoning puzzles",
          "math": "math", "coding": "coding", "extraction": "extracting information from a text",
          "stem": "science and technology", "humanities": "history, society and the arts"}
MATH_EXAMPLES = [
    ("a bakery", "A bakery sells muffins for $3 each and cookies for $1 each. Lena buys 4 muffins "
                 "and 6 cookies. How much does she spend?"),
    ("a bus trip", "A bus carries 42 people. At the first stop 9 people get off and 5 get on. At "
                   "the second stop half of the passengers get off. How many people are left?"),
    ("a garden", "Tom plants 5 rows of tomatoes with 8 plants in each row. Each plant gives 6 "
                 "tomatoes. How many tomatoes does he harvest?")]
FOLLOWUPS: dict[str, list[str]] = {
    "writing": ["Rewrite your previous response in exactly four sentences.",
                "Now make it more formal.", "Rewrite it for a ten-year-old reader."],
    "roleplay": ["Stay in character: what would you do next?",
                 "Continue the conversation and ask me a question in character."],
    "reasoning": ["Explain your reasoning step by step.",
                  "How would the answer change if one of the facts were different?"],
    "math": ["Can you check your answer in another way?",
             "Now solve a similar problem with different numbers."],
    "coding": ["Can you add comments and a few test cases?",
               "Now make the code more efficient and explain the change."],
    "extraction": ["Now return the same information as JSON.",
                   "Present the result as a bullet list."],
    "stem": ["Explain it to a high school student.", "Give a real-world example."],
    "humanities": ["Give two counterarguments.", "Summarize your answer in three bullet points."],
}
MATH_TOPICS = ["shopping at a market", "baking cookies", "a road trip", "farm animals",
               "school supplies", "saving pocket money", "a birthday party", "a bookstore",
               "painting a house", "a soccer season", "a garden", "a bakery", "train tickets",
               "a lemonade stand", "a library", "recycling cans", "a zoo", "a pizza order",
               "running laps", "a fish tank", "a toy factory", "a movie theater", "buying fruit",
               "a hiking trip", "a classroom", "a charity sale", "a car wash", "knitting scarves"]
STOPS = ("\n\n", "\nTopic:")  # the end of the written request in the few-shot list
CODE_EXAMPLES = [
    ("strings", 'def count_vowels(text: str) -> int:\n    """ Return how many vowels (a, e, i, o, u) '
                'the text contains.\n    >>> count_vowels(\'banana\')\n    3\n    """'),
    ("lists", 'from typing import List\n\n\ndef running_max(numbers: List[int]) -> List[int]:\n'
              '    """ Return the largest value seen so far at every position of the list.\n'
              '    >>> running_max([1, 3, 2, 5])\n    [1, 3, 3, 5]\n    """'),
    ("dates", 'def is_leap_year(year: int) -> bool:\n    """ Return True if the year is a leap year '
              'in the Gregorian calendar.\n    >>> is_leap_year(2024)\n    True\n    """')]
CODE_TOPICS = ["strings", "lists", "dictionaries", "prime numbers", "sorting", "matrices",
               "recursion", "searching", "sets", "text parsing", "geometry", "bit manipulation",
               "counting", "intervals", "stacks", "number sequences", "dates", "palindromes",
               "digits of numbers", "words in a sentence", "grades", "shopping carts", "binary strings",
               "anagrams"]


@dataclass(frozen=True)
class Seed_:
    """One request to write: the few-shot text the target continues and what it is about."""

    category: str
    topic: str
    shots: tuple[int, ...]      # indices of the examples shown
    text: str


def fewshot(header: str, field_name: str, shots: Sequence[tuple[str, str]], topic: str) -> str:
    """A "Topic: / <field>:" list of examples ending with the new topic's open field (code
    starts on the next line)."""
    sep = "\n" if field_name == "Function" else " "
    body = "".join(f"Topic: {t}\n{field_name}:{sep}{r}\n\n" for t, r in shots)
    return f"{header}\n\n{body}Topic: {topic}\n{field_name}:{sep.strip(' ')}"


def seeds(name: str, count: int, rng: random.Random) -> list[Seed_]:
    """``count`` draws of (category, topic, two of its examples); categories round-robin."""
    out = []
    cats = list(TOPICS)
    for i in range(count):
        if name == "selfchat":
            cat = cats[i % len(cats)]
            topic, examples = rng.choice(TOPICS[cat]), EXAMPLES[cat]
            header, field_name = f"Requests that users sent to an AI assistant ({LABELS[cat]}):", "Request"
        elif name == "selfmath":
            cat, topic, examples = "math", rng.choice(MATH_TOPICS), MATH_EXAMPLES
            header, field_name = "Grade-school math word problems:", "Problem"
        elif name == "selfcode":
            cat, topic, examples = "code", rng.choice(CODE_TOPICS), CODE_EXAMPLES
            header, field_name = "Python functions to implement (signature and docstring):", "Function"
        else:
            raise FlashSpecError(f"unknown synthetic prompt set {name!r}; choose {SYNTH_DATASETS}")
        shots = tuple(rng.sample(range(len(examples)), 2))
        text = fewshot(header, field_name, [examples[j] for j in shots], topic)
        out.append(Seed_(cat, topic, shots, text))
    return out


def clean(text: str | None, code: bool = False) -> str | None:
    """The request in a generated continuation (up to the next list entry), or None when it
    never ended or is too short/long to be one (code: up to the docstring's close)."""
    if text is None:
        return None
    if code:
        return clean_stub(text)
    cut = min((i for i in (text.find(stop) for stop in STOPS) if i >= 0), default=-1)
    if cut < 0:
        return None
    text = text[:cut].strip().strip('"').strip()
    if len(text) < 20 or len(text) > 1200 or len(text.split()) < 4:
        return None
    return text


def clean_stub(text: str) -> str | None:
    """A ``def`` line with its docstring (and what came before it, e.g. imports), or None."""
    start = text.find("def ")
    opened = text.find('"""', start) if start >= 0 else -1
    closed = text.find('"""', opened + 3) if opened >= 0 else -1
    if closed < 0:
        return None
    stub = text[:closed + 3].strip("\n").rstrip()
    if "Topic:" in stub or len(stub) < 30 or len(stub) > 1500:
        return None
    return stub


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


def real_texts() -> set[str]:
    """Normalised user turns (and GSM8K questions) of every real prompt, both splits."""
    out: set[str] = set()
    for name in DATASETS:
        for p in all_prompts(name):
            out.update(normalise(t) for t in p.turns)
            for key in ("question", "code"):
                if p.meta.get(key):
                    out.add(normalise(str(p.meta[key])))
    return out


def cache_key(name: str, n: int, seed: int, target: str) -> str:
    blob = json.dumps({"name": name, "n": n, "seed": seed, "target": target, "version": VERSION,
                       "sampling": REQUEST_SAMPLING, "tokens": REQUEST_TOKENS[name],
                       "followup": FOLLOWUP_FRACTION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def to_prompt(name: str, index: int, seed: int, s: Seed_, request: str, rng: random.Random
              ) -> Prompt:
    """A Prompt for one kept request (selfmath: GSM8K-formatted; selfcode: HumanEval-formatted;
    selfchat: maybe 2 turns)."""
    if name == "selfmath":
        turns = [format_gsm8k(request)]
    elif name == "selfcode":
        turns = [format_humaneval(request)]
    else:
        turns = [request]
        if rng.random() < FOLLOWUP_FRACTION:
            turns.append(rng.choice(FOLLOWUPS[s.category]))
    domain = {"selfmath": "math", "selfcode": "code"}.get(name, "chat")
    return Prompt(id=f"{name}/{seed}-{index}", dataset=name, domain=domain, category=s.category,
                  turns=turns,
                  meta={"topic": s.topic, "shots": list(s.shots), "request": request})


@torch.inference_mode()
def write_requests(target, tokenizer, texts: Sequence[str], seed: int, batch_size: int,
                   progress: bool = True, max_new_tokens: int = 80) -> list[str]:
    """The target's raw continuation of each few-shot text (no chat template); one that ends
    in EOS gets the list's next-entry marker, so it counts as finished."""
    from flashspec.core import Arm
    from flashspec.engine import SpecEngine
    from flashspec.core import SamplingParams
    eos = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    engine = SpecEngine(target, [Arm()], params=SamplingParams(*REQUEST_SAMPLING),
                        seed=seed + 7919, eos_ids=eos)
    ids = [tokenizer(text)["input_ids"] for text in texts]
    out: list[str] = []
    bar = tqdm(total=len(ids), desc="write prompts", unit="seq", disable=not progress)
    for lo in range(0, len(ids), batch_size):
        rows = engine.generate(ids[lo:lo + batch_size], max_new_tokens).rows
        for row in rows:
            ended = bool(row.tokens) and row.tokens[-1] in eos
            text = tokenizer.decode(row.tokens, skip_special_tokens=True)
            out.append(text + "\nTopic:" if ended else text)
        bar.update(len(rows))
    bar.close()
    return out


def synth_prompts(target, tokenizer, name: str, n: int, seed: int, batch_size: int,
                  cache_root: Path | None, target_tag: str, progress: bool = True
                  ) -> tuple[list[Prompt], dict[str, Any]]:
    """``n`` self-generated prompts of set ``name`` (fewer if too few survive the filters) and
    their provenance (cache key, counts per category, what was checked)."""
    key = cache_key(name, n, seed, target_tag)
    path = cache_root / "prompts" / f"{name}-{key}.json" if cache_root is not None else None
    if path is not None and path.is_file():
        blob = json.loads(path.read_text())
        log.info("synthetic prompts: cache hit %s", path)
        return [Prompt(**p) for p in blob["prompts"]], blob["provenance"]
    t0 = time.perf_counter()
    rng = random.Random(f"{VERSION}:{name}:{seed}")
    draws = seeds(name, max(n, int(n * OVERSAMPLE) + 8), rng)
    texts = write_requests(target, tokenizer, [s.text for s in draws], seed, batch_size, progress,
                           REQUEST_TOKENS[name])
    banned, seen, prompts = real_texts(), set(), []
    rejected = {"unusable": 0, "duplicate": 0, "copy": 0}
    shown = {normalise(r) for ex in [*EXAMPLES.values(), MATH_EXAMPLES, CODE_EXAMPLES]
             for _, r in ex}
    for s, text in zip(draws, texts):
        request = clean(text, code=name == "selfcode")
        norm = normalise(request) if request else ""
        reason = ("unusable" if request is None else "duplicate" if norm in seen else
                  "copy" if norm in banned or norm in shown else None)
        if reason:
            rejected[reason] += 1
            continue
        if len(prompts) < n:
            seen.add(norm)
            prompts.append(to_prompt(name, len(prompts), seed, s, request, rng))
    prov = {"name": name, "key": key, "version": VERSION, "requested": n, "kept": len(prompts),
            "written": len(draws), "rejected": rejected, "seed": seed,
            "sampling": dict(zip(("temperature", "top_k", "top_p"), REQUEST_SAMPLING)),
            "max_new_tokens": REQUEST_TOKENS[name], "followup_fraction": FOLLOWUP_FRACTION,
            "categories": {c: sum(p.category == c for p in prompts)
                           for c in dict.fromkeys(p.category for p in prompts)},
            "disjoint_from": "every prompt (both splits) of " + ", ".join(DATASETS),
            "wall_s": round(time.perf_counter() - t0, 2)}
    log.info("synthetic prompts %s: kept %d of %d written (%s) in %.1fs", name, len(prompts),
             len(draws), rejected, prov["wall_s"])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"id": p.id, "dataset": p.dataset, "domain": p.domain, "category": p.category,
                 "turns": p.turns, "meta": p.meta} for p in prompts]
        path.write_text(json.dumps({"provenance": prov, "prompts": rows}, indent=0) + "\n")
    return prompts, prov
