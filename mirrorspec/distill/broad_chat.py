"""Prompt set 2's chat prompts: many more phrasings, subjects and constraints than set 1's.

Set 1's chat prompts are 27 templates over 60 topics. The draft distilled from the target's answers
to them agrees with the target at 0.59 of held-out positions of that same distribution, and at 0.33
on MT-Bench's first turns: it learned the answers to a narrow family of questions, not the target's
chat. These prompts widen the family along the axes a chat benchmark varies: who asks, in what
genre, about what, under which constraint (length, format, audience), and with a text to work on
(extraction and editing over short generated passages). They are written here, in the spirit of
MT-Bench's eight categories, and share no question with it or with HumanEval. With the same
teacher budget (10,240 prompts), the draft distilled on set 2 raised greedy acceptance on
MT-Bench's first 80 first turns from 0.331 to 0.365 and kept HumanEval's (0.569, 0.565); the
shipped draft, on twice the data (``prompts.more_chat_prompts`` past the pool), reaches 0.394
and 0.562.
"""

from __future__ import annotations

import random

_SUBJECTS = [
    "the water cycle", "black holes", "photosynthesis", "the French Revolution", "machine learning",
    "climate change", "the stock market", "vaccines", "the Roman Empire", "renewable energy",
    "quantum computing", "the human brain", "jazz music", "coffee", "remote work", "social media",
    "electric cars", "the Renaissance", "volcanoes", "honey bees", "the internet", "chess",
    "meditation", "the Moon landing", "inflation", "ancient Egypt", "recycling", "sleep", "DNA",
    "earthquakes", "the printing press", "public libraries", "time management", "bridges",
    "friendship", "democracy", "the Silk Road", "marathon training", "origami", "cloud computing",
    "urban gardening", "the Industrial Revolution", "rainforests", "video games", "supply chains",
    "the immune system", "space telescopes", "minimalism", "public speaking", "Shakespeare",
    "the Olympic Games", "cryptography", "coral reefs", "nuclear power", "museums", "tides",
    "learning a new language", "the history of money", "the ethics of artificial intelligence",
    "plate tectonics", "antibiotics", "the Cold War", "impressionist painting", "the blockchain",
    "plastic pollution", "the Great Wall of China", "electric guitars", "mountain climbing",
    "the theory of evolution", "carbon taxes", "universal basic income", "the placebo effect",
    "the Byzantine Empire", "gene editing", "solar panels", "migratory birds", "the Amazon river",
    "the Cambrian explosion", "compound interest", "opera", "the Hubble constant", "microplastics",
    "the gig economy", "ancient Greek philosophy", "hydroelectric dams", "the Maya civilization",
    "fermentation", "sourdough bread", "wind turbines", "the periodic table", "sign language",
    "the Apollo program", "inflation targeting by central banks", "board games", "podcasts",
    "wildfires", "glaciers", "the Fibonacci sequence", "the speed of light", "3D printing",
    "self-driving cars", "mindfulness at work", "the Harlem Renaissance", "the Ottoman Empire",
    "the water footprint of food", "vertical farming", "haiku", "the Nile", "drones", "cholesterol",
    "the history of the bicycle", "graphic novels", "the scientific method", "semiconductors",
    "the Little Ice Age", "public transport", "tax policy", "online privacy", "the Enlightenment",
]
_ROLES = [
    "a pirate captain", "a medieval knight", "a detective", "a tour guide in Kyoto", "a chef",
    "a startup founder", "a high-school physics teacher", "a space station engineer", "a librarian",
    "a sports commentator", "a museum curator", "a marine biologist", "a travel blogger",
    "a family doctor", "a financial advisor", "a relationship coach", "a stand-up comedian",
    "a park ranger", "a Victorian novelist", "a barista", "a personal trainer", "a software architect",
    "a kindergarten teacher", "a lawyer", "a poet", "a news anchor", "a farmer", "an astronaut",
    "a philosopher", "a real-estate agent", "a historian of science", "a video game designer",
]
_AUDIENCES = [
    "a ten-year-old", "a busy executive", "a first-year university student", "my grandmother",
    "a room of software engineers", "someone who has never heard of it", "a skeptical journalist",
    "high-school students", "a non-native English speaker", "an expert in the field",
]
_GENRES = [
    "a short blog post", "a limerick", "a haiku sequence", "a product description", "a news report",
    "a diary entry", "a motivational speech", "a short story", "a dialogue between two friends",
    "a formal letter", "a tweet thread", "a radio advertisement", "a movie plot summary",
    "a recipe introduction", "a podcast intro script", "a cover letter", "an op-ed",
    "a children's bedtime story", "a eulogy for an old computer", "a sonnet",
]
_CODE_TASKS = [
    "reverses the words in a sentence", "checks whether two strings are anagrams",
    "returns the k most frequent elements of a list", "validates a Sudoku board",
    "computes the edit distance between two strings", "finds all primes below n with a sieve",
    "merges overlapping intervals", "parses a query string into a dictionary",
    "implements an LRU cache", "converts a Roman numeral to an integer",
    "finds the longest common prefix of a list of strings", "detects a cycle in a linked list",
    "implements breadth-first search on a graph", "counts the islands in a grid of 0s and 1s",
    "serializes a binary tree to a string", "computes the running average of a stream",
    "groups anagrams together", "finds the majority element of an array",
    "returns the nth row of Pascal's triangle", "checks whether parentheses are balanced",
    "computes the power set of a list", "converts a number to its binary representation",
    "finds the kth smallest element of an unsorted array", "reads a JSON file and prints its keys",
    "downloads nothing but simulates a retry loop with exponential backoff",
    "implements a queue with two stacks", "compresses a string with run-length encoding",
]
_LANGUAGES = ["Python", "JavaScript", "C++", "Java", "Go", "Rust", "SQL", "TypeScript", "C", "Bash"]
_NAMES = ["Alice", "Ben", "Chen", "Dara", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi",
          "Luca", "Maya", "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara"]
_COMPANIES = ["Northwind", "Bluepeak Labs", "Greenfield Foods", "Orbitron", "Maple Bank", "Tidewater Energy",
              "Lumen Robotics", "Riverstone Books", "Cobalt Motors", "Helios Health"]
_CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Lima", "Perth", "Hanoi", "Oslo", "Austin"]
_PRODUCTS = ["wireless earbuds", "a standing desk", "a robot vacuum", "a budget smartphone", "a coffee grinder",
             "a hiking backpack", "an e-reader", "a smartwatch", "a gaming laptop", "an air fryer"]
_CONSTRAINTS = [
    "Keep it under 100 words.", "Use exactly three paragraphs.", "Answer in bullet points.",
    "Use simple words.", "Include one concrete example.", "End with a question for the reader.",
    "Make it humorous.", "Write it in a formal tone.", "Start every sentence with the letter S.",
    "Give your answer as a numbered list.", "Explain your reasoning step by step.",
    "Summarize your answer in one sentence at the end.", "Avoid technical jargon.",
    "Use a table if it helps.", "Keep it to two sentences.",
]

_WRITING = [
    "Write {genre} about {subject}.",
    "Write {genre} about {subject} for {audience}.",
    "Compose {genre} in which {name} discovers something surprising about {subject}.",
    "Draft an email to {name}, a colleague at {company}, asking for feedback on a proposal about {subject}.",
    "Write a persuasive message convincing a friend who dislikes crowds to visit {city}.",
    "Describe a memorable character who works as {role}, in vivid language.",
    "Write a catchy headline and a short introduction for an article about {subject}.",
    "Rewrite this sentence to be clearer and more engaging: \"{subject} is a thing that many people think about and it is important.\"",
    "Write a review of {product} comparing it with its main competitor.",
    "Plan a three-day trip to {city}, with one paragraph per day.",
]
_ROLEPLAY = [
    "Pretend you are {role}. Explain {subject} to {audience}.",
    "Act as {role} and give me five tips about {subject}.",
    "You are {role}. Describe your most unusual day at work.",
    "Take on the role of {role}. A customer asks you about {product}; answer in character.",
    "Imagine you are {role} in the year 1900. What do you think of {subject}?",
    "Stay in character as {role} for the rest of this conversation. First question: what do you love about your job?",
    "Role-play a conversation between {role} and {role2} about {subject}.",
    "As {role}, how would you help {name}, who feels stuck and unmotivated?",
]
_REASONING = [
    "{name} is taller than {name2}, and {name2} is taller than {name3}. Who is the shortest? Explain.",
    "If it takes {a} workers {b} hours to paint a house, how long would it take {c} workers? State your assumptions.",
    "{name} has {a} brothers. Each brother has {b} sisters. How many sisters does {name} have if {name} is a girl?",
    "A bat and a ball cost {a}.10 dollars together. The bat costs {a} dollars more than the ball. How much is the ball?",
    "Which word does not belong: apple, banana, {subject_word}, cherry? Explain your choice.",
    "In a race you overtake the person in position {b}. What position are you in now? Explain.",
    "Three boxes are labelled apples, oranges and mixed, and every label is wrong. How can you fix the labels by picking one fruit?",
    "If all bloops are razzies and some razzies are lazzies, must some bloops be lazzies? Explain.",
    "{name} says: \"I always lie.\" Is that statement true or false? Discuss.",
    "A clock shows {h}:{m:02d}. What is the angle between the hour and minute hands?",
]
_MATH = [
    "What is {a} multiplied by {b}? Show your work.",
    "Solve the system: x + y = {c} and x - y = {b}.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "Find the area of a triangle with vertices at (0, 0), ({a}, 0) and (0, {b}).",
    "If you roll two fair dice, what is the probability that the sum is {d}?",
    "An investment of {c}00 dollars grows {p}% per year. How much is it worth after {y} years?",
    "What is the derivative of x^{y} + {a}x?",
    "How many integers satisfy |x - {b}| < {a}?",
    "The average of {y} numbers is {a}. One number is removed and the average becomes {b}. What was removed?",
    "What is the remainder when {c} is divided by {d}?",
    "Convert {a} kilometres per hour to metres per second.",
    "A train leaves at {h}:00 going {a} km/h; another leaves an hour later going {c} km/h. When does the second catch up?",
]
_CODING = [
    "Write a {language} function that {code_task}.",
    "Write a {language} function that {code_task}. Include a few test cases.",
    "Explain how you would write a program that {code_task}, then give the code in {language}.",
    "What is the time complexity of a function that {code_task}? Give an efficient {language} implementation.",
    "Review this idea: a {language} script that {code_task} using nested loops. How could it be faster?",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "What does the {language} keyword or concept of '{concept}' mean? Give an example.",
    "Write a simple HTML page with a button that shows a random joke about {subject} when clicked.",
    "Write an SQL query that finds the top {b} customers by total order value.",
    "Find the bug: my {language} function that {code_task} fails on empty input. How do I fix it?",
]
_EXTRACTION = [
    "Extract the people, companies and places from this text as JSON:\n\n{news}",
    "Summarize this announcement in one sentence:\n\n{news}",
    "From the following review, give a rating from 1 to 5 and the main reason:\n\n{review}",
    "Identify the product and list its pros and cons from this review:\n\n{review}",
    "Turn this text into a table with columns for name, company and city:\n\n{news}",
    "Classify each item into fruit, vegetable or grain: apple, rice, carrot, barley, mango, spinach, oats.",
    "Give the main topic of this passage in five words or fewer:\n\n{news}",
    "Correct the grammar in this paragraph:\n\n{broken}",
]
_STEM = [
    "Explain how {subject} works.",
    "What are the main causes and effects of {subject}?",
    "Describe the science behind {subject} for {audience}.",
    "What is the biggest open question about {subject}, and why does it matter?",
    "How would you design an experiment to test a claim about {subject}?",
    "Compare {subject} and {subject2}: what do they have in common, and how do they differ?",
    "What are the practical applications of {subject}?",
]
_HUMANITIES = [
    "Discuss the influence of {subject} on modern society.",
    "Give a brief history of {subject}.",
    "What are three common misconceptions about {subject}?",
    "How has {subject} shaped culture in {city}, or in cities like it?",
    "What would a philosopher say about {subject}? Present two opposing views.",
    "What are the advantages and disadvantages of {subject}?",
    "How might {subject} change over the next twenty years?",
    "What lessons from {subject} apply to everyday life?",
]
CATEGORIES = {"writing": _WRITING, "roleplay": _ROLEPLAY, "reasoning": _REASONING, "math": _MATH,
              "coding": _CODING, "extraction": _EXTRACTION, "stem": _STEM, "humanities": _HUMANITIES}
_CONCEPTS = ["closure", "generator", "pointer", "interface", "recursion", "async/await", "immutability",
             "garbage collection", "type inference", "decorator", "ownership", "polymorphism"]


def _news(rng: random.Random) -> str:
    name, name2 = rng.sample(_NAMES, 2)
    company, city, subject = rng.choice(_COMPANIES), rng.choice(_CITIES), rng.choice(_SUBJECTS)
    return (f"{name}, chief executive of {company}, said on Tuesday that the company will open a new office in "
            f"{city} next year, creating {rng.randint(20, 900)} jobs. The move follows a partnership with {name2}'s "
            f"research group, which studies {subject}. Local officials welcomed the news.")


def _review(rng: random.Random) -> str:
    product, good = rng.choice(_PRODUCTS), rng.random() < 0.5
    verdict = ("works better than I expected and the battery lasts for days" if good else
               "stopped working after two weeks and support never replied")
    return f"I bought {product} last month. Setup took {rng.randint(2, 40)} minutes. Honestly it {verdict}."


def _broken(rng: random.Random) -> str:
    name, subject = rng.choice(_NAMES), rng.choice(_SUBJECTS)
    return f"{name} have went to the library yesterday for reading about {subject}, but they was closed so she goes home."


def _fill(template: str, rng: random.Random) -> str:
    subject, subject2 = rng.sample(_SUBJECTS, 2)
    role, role2 = rng.sample(_ROLES, 2)
    name, name2, name3 = rng.sample(_NAMES, 3)
    return template.format(
        subject=subject, subject2=subject2, subject_word=subject.split()[-1], role=role, role2=role2,
        audience=rng.choice(_AUDIENCES), genre=rng.choice(_GENRES), name=name, name2=name2, name3=name3,
        company=rng.choice(_COMPANIES), city=rng.choice(_CITIES), product=rng.choice(_PRODUCTS),
        language=rng.choice(_LANGUAGES), code_task=rng.choice(_CODE_TASKS),
        concept=rng.choice(_CONCEPTS), news=_news(rng), review=_review(rng), broken=_broken(rng),
        a=rng.randint(2, 60), b=rng.randint(2, 30), c=rng.randint(31, 250), d=rng.randint(3, 12),
        h=rng.randint(1, 12), m=rng.randrange(0, 60, 5), p=rng.randint(2, 12), y=rng.randint(2, 6))


def broad_chat_prompts(rng: random.Random, n: int, constraint_rate: float = 0.3,
                       max_repeats_in_a_row: int = 100_000) -> list[str]:
    """``n`` distinct prompts, categories in turn, some with a constraint appended; fewer where a
    category runs dry (``max_repeats_in_a_row`` draws repeat earlier prompts: the family holds
    ~242k, and past them the loop drew forever).

    A draw that repeats an earlier prompt (a template without slots) is drawn again: the target's
    answer to a repeated prompt teaches the draft little and costs as much as a new one.
    """
    categories = sorted(CATEGORIES)
    out: list[str] = []
    seen: set[str] = set()
    repeats = 0
    while len(out) < n and repeats < max_repeats_in_a_row:
        text = _fill(rng.choice(CATEGORIES[categories[len(out) % len(categories)]]), rng)
        if rng.random() < constraint_rate:
            text += " " + rng.choice(_CONSTRAINTS)
        if text in seen:
            repeats += 1
            continue
        repeats = 0
        seen.add(text)
        out.append(text)
    return out
