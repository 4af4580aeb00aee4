"""A prompt corpus built on this machine (no hub, no network) for self-distilling draft heads.

Owns: four prompt sources, woven in a fixed ratio (``_WEAVE``) in a deterministic shuffled order:
- ``docs``: Python's own documentation (``pydoc_data.topics`` and standard-library docstrings, PSF
  licensed) through task templates (explain, summarize, write code, answer, rewrite as JSON);
- ``chat``: open-ended requests (stories, poems, speeches, advice, explanations, lists, letters,
  plans, scenes, advertisements) made from subjects and task templates written here, and
  everyday how / why questions;
- ``json``: extraction of synthetic records (made from name, place and item lists written here)
  into JSON objects with named keys;
- ``multilingual``: short requests in French, German, Spanish, Italian and Portuguese.
Deduplicated, and excluding every prompt of the benchmark workloads (``../shared/workloads/*.jsonl``):
a corpus prompt is dropped when it equals a workload prompt or shares a run of 8 words with one (so
the benchmark stays held out; no chat subject phrase here occurs in a chat workload prompt).
Also: ``workload_overlap`` (that held-out rule, for other prompt sources too) and ``weave`` (prompt
lists taken in turn: the corpus with requests the target writes, ``cluster.training.self_prompts``,
and an operator's own prompts, ``cluster.training.prompt_file``).
Ignores: tokenizing and generating (``cluster.training.self_distill``).
"""
from __future__ import annotations

import importlib
import json
import random
import re
import warnings
from pathlib import Path
from typing import Callable

from cluster.common.prompt_rows import DEFAULT_WORKLOADS

_SHINGLE = 8  # words: a corpus prompt sharing this many consecutive words with a workload prompt is dropped

_MODULES = ("json", "re", "os", "pathlib", "collections", "itertools", "functools", "datetime", "string",
            "textwrap", "random", "statistics", "math", "heapq", "bisect", "csv", "argparse", "logging",
            "dataclasses", "enum", "typing", "shutil", "subprocess", "urllib.parse", "http.client", "socket",
            "threading", "queue", "asyncio", "contextlib", "copy", "difflib", "fractions", "decimal",
            "hashlib", "base64", "zipfile", "tarfile", "sqlite3", "unittest", "inspect", "ast", "tokenize")

_TEMPLATES = (
    "Explain in simple words what the following Python documentation says:\n\n{text}",
    "Summarize this in three sentences:\n\n{text}",
    "Write a short Python example that demonstrates the following:\n\n{text}",
    "A beginner asks: what is `{name}` in Python and when would I use it? Here is the reference:\n\n{text}",
    "Rewrite the key facts of this text as a JSON object with the keys \"name\", \"purpose\" and \"example\":\n\n{text}",
    "What are the most common mistakes people make with `{name}`? Use this reference:\n\n{text}",
    "Translate the following explanation into French:\n\n{text}",
    "Write a Python function that uses `{name}` and explain it step by step.",
)


_CHAT_SUBJECTS = (
    "a village baker", "a lost umbrella", "winter camping", "a broken clock", "learning to swim", "a city bus driver",
    "a rainy Sunday", "an old map", "the first snow", "a jazz musician", "saving money", "a small garden on a balcony",
    "a train station at night", "a retired astronaut", "a busy kitchen", "a shy octopus", "a desert caravan",
    "moving to a new city", "a lost key", "a museum guard", "a paper airplane", "a long hike", "a quiet island",
    "a street market", "an old radio", "a chess tournament", "a bee colony", "a volcano", "a summer festival",
    "a submarine crew", "a kite", "a snowstorm", "a time traveller", "a forgotten song", "a talking parrot",
    "a coffee shop", "a mountain village", "a hot air balloon", "an underground river", "a football match",
    "a night sky full of stars", "public speaking", "healthy breakfast ideas", "recycling at home",
    "learning to draw", "time management", "a job interview", "planting tomatoes", "keeping a journal",
    "a birthday surprise", "a school science fair", "a family dinner", "an electric car", "a power outage",
    "a bridge", "the history of bread", "a violin maker", "an ant colony", "a polar bear", "a rainforest",
    "a sailing trip", "a lighthouse in a storm", "the moon landing", "a bookshop owner", "an inventor's workshop",
    "a snowman", "a carnival", "a farmer's market", "a desert at night", "an old castle", "a firefighter",
    "a nurse on a night shift", "a marathon", "a vegetable soup", "a ghost who is afraid of people",
    "a pet turtle", "a tiny robot", "a treasure hunt", "a thunderstorm", "a fishing boat", "a quiet morning",
    "a noisy neighbour", "a new language", "an apple orchard", "a mountain lake", "a clockmaker",
    "a detective", "a pirate ship", "a space station", "an orchestra", "a penguin", "a city park",
    "a cargo ship", "an abandoned amusement park", "a beekeeper", "a haunted bookshop", "a mountain rescue team",
    "a stray kitten", "a night train to the coast", "a village well", "a secret tunnel", "a glassblower",
    "a weather balloon", "a giant tortoise", "a school bus", "a clock tower", "a small bakery that opens at dawn",
    "a lost glove", "an ice rink", "a lighthouse cat", "a wind farm", "a traffic jam", "a magic paintbrush",
    "a potter's wheel", "a tea ceremony", "a rooftop garden", "a circus acrobat", "a ferry crossing",
    "a desert oasis", "a coral reef", "a lonely satellite", "a vending machine", "a river delta",
    "a mountain goat", "a silent film", "a street musician", "a hot spring", "a paper lantern", "a bicycle courier",
    "a puppet theatre", "a long winter", "a school library", "a cheese maker", "a wandering knight",
    "a subway map", "a migrating flock of geese", "a village doctor", "a bowl of noodles", "a forgotten attic",
    "a toy shop", "a harbour at sunset", "a wolf pack", "a recycling plant", "a sandcastle", "a tailor",
    "a carousel", "a solar eclipse", "a monastery in the hills", "a homemade kite", "a chess-playing computer",
)
_CHAT_TASKS = (
    "Write a short story about {s}.",
    "Write a poem about {s}.",
    "Give me five interesting facts about {s}.",
    "Explain {s} to a child in a few sentences.",
    "Write a diary entry written by {s}, or by someone who meets {s}.",
    "What are some good tips about {s}? Give a numbered list.",
    "Describe {s} in vivid detail.",
    "Write a funny dialogue that involves {s}.",
    "Write a short news report about {s}.",
    "Give me three questions a curious person might ask about {s}, and answer them.",
    "Write a letter to a friend about {s}.",
    "Describe the sounds and smells of {s}.",
    "Write a song chorus about {s}.",
    "What could go wrong with {s}, and how would you fix it?",
    "Write a riddle whose answer is {s}, then explain the answer.",
    "Write a motivational message inspired by {s}.",
    "Plan an afternoon around {s} and explain each step.",
    "Write the first paragraph of a novel that begins with {s}.",
    "Write a haiku about {s}.",
    "Write a limerick about {s}.",
    "Write a bedtime story about {s} for a five-year-old.",
    "Write a fable about {s} that ends with a moral.",
    "Write a funny short story about {s}.",
    "Write a short speech about {s} for a school assembly.",
    "Write an advertisement for {s}.",
    "What are the advantages and disadvantages of {s}?",
    "Write a blog post about {s}.",
    "Write a conversation between two friends about {s}.",
    "Describe {s} from the point of view of a cat.",
    "Write a scene for a play about {s}.",
    "Write a short mystery story involving {s}.",
    "Imagine {s} a hundred years from now and describe it.",
    "Write a postcard from a trip that involved {s}.",
    "Write a children's rhyme about {s}.",
    "Write an encyclopedia-style entry about {s}.",
    "Write a job advertisement for someone who works with {s}.",
    "Pretend to be {s} and introduce yourself in a friendly paragraph.",
    "Tell a legend that explains where {s} came from.",
    "Write a product review of {s} as if it were something you could buy.",
    "Invent a game for children that is based on {s}, and explain how to play it.",
    "Write a short essay with an introduction, two arguments and a conclusion about {s}.",
    "Write a thank-you card to {s}.",
    "If {s} could talk, what would it complain about? Write it as a monologue.",
    "Write three short tweets about {s}.",
    "Write a short travel guide entry for a place known for {s}.",
    "Give me a step-by-step plan for a weekend project related to {s}.",
    "Write a sonnet about {s}.",
    "Describe a morning with {s}, hour by hour.",
    "Compare {s} with something from the past and explain what changed.",
    "Write an interview with {s} for a local newspaper.",
    "List ten words that remind you of {s} and use them in a short paragraph.",
    "Write a cheerful song verse about {s} for a birthday party.",
    "Write a short horror story about {s} that is not too scary.",
    "Teach me one surprising lesson we can learn from {s}.",
    "Write a menu for a restaurant inspired by {s}, with a sentence about each dish.",
    "Write a to-do list for someone who has to take care of {s}, with reasons.",
    "Write a short science-fiction story in which {s} saves the day.",
    "Describe {s} to someone who cannot see, using the other senses.",
    "Write a complaint letter about {s}, then a polite reply to it.",
    "Give a pep talk to a team that is about to deal with {s}.",
)
_CHAT_QUESTIONS = (
    "How does a refrigerator keep food cold?", "Why is the ocean salty?", "How do airplanes stay in the air?",
    "What causes the seasons?", "How do vaccines train the immune system?", "Why do leaves change color in autumn?",
    "How does a compass work?", "What is the difference between weather and climate?", "How do bees make honey?",
    "Why do we dream?", "How can I sleep better?", "How do I start running if I have never exercised?",
    "What should I pack for a week-long hiking trip?", "How can I make my small apartment feel bigger?",
    "What are good ways to remember new vocabulary?", "How do I write a good cover letter?",
    "What is a healthy way to deal with stress?", "How do I keep houseplants alive?",
    "What is the best way to save for a holiday?", "How can I be more productive in the morning?",
    "What are the benefits of learning a second language?", "Is it better to rent or to buy a home?",
    "What are some fun activities for a rainy weekend?", "How do electric cars differ from petrol cars?",
    "What makes a story interesting?", "How do I make a good first impression?",
    "What are some tips for cooking rice perfectly?", "How do I teach a dog to sit?",
    "What are the signs of a good teacher?", "How did ancient people tell time?",
    "Why is exercise good for the brain?", "What is inflation, in simple terms?",
    "How does the internet send a message across the world?", "Why do we have time zones?",
    "How do volcanoes form?", "How do I plan a birthday party on a budget?",
    "What are good questions to ask at the end of an interview?", "How can a family reduce food waste?",
    "What should I know before adopting a cat?", "How do I choose a good book to read?",
    "Why does bread rise?", "How do tides work?", "What is the water cycle?", "How do I politely say no to a friend?",
    "What is a good routine for studying for exams?", "How do noise-cancelling headphones work?",
    "Why do some people get seasick?", "How do I start a vegetable garden?", "What makes a good team leader?",
    "How do I prepare for a long flight?",
    "What would the world be like if nobody needed to sleep?", "What if the moon were twice as close to Earth?",
    "What would happen if all the bees disappeared?", "What if people could talk to animals?",
    "Suggest a name and a story for a new ice cream flavour.", "Invent a sport that can be played in zero gravity.",
    "Create a new superhero and describe their powers and weakness.", "Design a perfect school day for teenagers.",
    "What is the most useful skill to learn this year, and why?", "How do I stay motivated when learning something hard?",
    "What are some ways to make new friends as an adult?", "How should I prepare for my first marathon?",
    "What are good habits for a healthy life?", "Why do people enjoy scary movies?",
    "How do birds know where to migrate?", "Why is the sky blue? Answer like a pirate.",
    "What is the difference between a virus and a bacterium?", "How does a bicycle stay upright?",
    "Explain how a rocket reaches space.", "What is photosynthesis, and why does it matter?",
    "How do I cook a simple dinner for four people?", "Give me a packing list for a beach holiday.",
    "What questions should I ask before buying a used car?", "How can I make my presentations more engaging?",
    "What are some creative ways to celebrate a friend's success?", "How do I apologise to someone I hurt?",
    "Give me ideas for a rainy day with small children.", "What are the rules of chess, briefly?",
    "Write a recipe for pancakes and explain each step.", "What are some tips for taking better photos with a phone?",
    "How can I learn to cook without wasting food?", "What are fun things to do in a small town?",
    "Why do we laugh?", "How does memory work in the brain?", "What makes music sound happy or sad?",
    "Describe what a perfect weekend looks like.", "Invent a new holiday tradition for a family.",
    "What would a school for dragons teach?", "Write a short story that starts with a knock on the door at midnight.",
    "Tell me a story about a mail carrier who delivers letters to the wrong planet.", "Write a poem about the city at dawn.",
    "What would you put in a time capsule for people in the year 2200?", "Describe a market on another planet.",
    "Write a bedtime story about a sleepy dragon.", "How can I write better emails at work?",
    "Is life in the countryside better than life in a big city?", "Give me advice for learning to play the piano as an adult.",
    "What do astronauts eat in space?", "Why do onions make people cry?", "How do submarines dive and surface?",
)
_PEOPLE = ("Maria Lopez", "Tom Becker", "Aiko Sato", "Omar Farouk", "Nina Petrova", "Lucas Moreau", "Sara Lind",
           "Ravi Kumar", "Julia Rossi", "Ethan Brooks", "Mei Wong", "Pedro Alves", "Hana Novotna", "Ali Yilmaz")
_PLACES = ("Lisbon", "Oslo", "Nairobi", "Toronto", "Osaka", "Lyon", "Krakow", "Austin", "Melbourne", "Porto",
           "Seville", "Dublin", "Quito", "Hanoi")
_JOBS = ("pharmacist", "architect", "carpenter", "pilot", "librarian", "chef", "electrician", "translator",
         "veterinarian", "journalist", "plumber", "dentist")
_ITEMS = ("desk lamp", "rain jacket", "coffee grinder", "backpack", "wireless mouse", "tea kettle", "yoga mat",
          "bookshelf", "bicycle helmet", "water bottle", "notebook", "toaster")


def _json_prompts(rng: random.Random, n: int) -> list[str]:
    """Synthetic extraction tasks: a sentence about a record, keys named, JSON asked for."""
    out = []
    for i in range(n):
        kind = i % 4
        person, place = rng.choice(_PEOPLE), rng.choice(_PLACES)
        if kind == 0:
            text = (f"{person} works as a {rng.choice(_JOBS)} in {place} and has been doing it for "
                    f"{rng.randint(1, 30)} years.")
            keys = "full_name, occupation, city, years"
        elif kind == 1:
            text = (f"Order {rng.randint(1000, 9999)}: {rng.randint(1, 9)} x {rng.choice(_ITEMS)} at "
                    f"{rng.randint(5, 200)}.{rng.randint(0, 99):02d} dollars each, shipped to {place}.")
            keys = "order_id, quantity, item, unit_price, destination"
        elif kind == 2:
            text = (f"{person} booked a flight from {place} to {rng.choice(_PLACES)} on "
                    f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}, seat {rng.randint(1, 40)}{rng.choice('ABCDEF')}.")
            keys = "passenger, origin, destination, date, seat"
        else:
            text = (f"The {rng.choice(_ITEMS)} costs {rng.randint(5, 300)} dollars, weighs {rng.randint(1, 40) / 10} kg "
                    f"and is sold by a shop in {place}.")
            keys = "product, price_usd, weight_kg, shop_city"
        out.append(f"Return only a JSON object with the keys {keys} for this text: {text}")
    return out


_MULTILINGUAL = (
    ("Écris un court poème sur {s}.", ("la pluie", "un vieux pont", "la forêt", "le marché du dimanche", "un train de nuit")),
    ("Explique en quelques phrases pourquoi {s} est important.", ("le sommeil", "l'eau potable", "la lecture", "le sport")),
    ("Schreibe eine kurze Geschichte über {s}.",
     ("einen alten Fischer", "eine kleine Stadt", "einen verlorenen Hund", "den ersten Schnee")),
    ("Nenne drei Tipps für {s}.", ("das Kochen", "das Lernen", "das Reisen", "einen Umzug")),
    ("Escribe una historia corta sobre {s}.", ("un faro", "una abuela sabia", "un tren antiguo", "un gato curioso")),
    ("¿Cuáles son las ventajas de {s}?", ("caminar cada día", "aprender idiomas", "cocinar en casa", "leer novelas")),
    ("Scrivi una breve poesia su {s}.", ("il mare d'inverno", "una piazza", "il caffè", "le montagne")),
    ("Descreva {s} em poucas frases.", ("uma feira de rua", "o seu bairro", "um dia de chuva", "uma viagem de barco")),
)


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + _SHINGLE]) for i in range(max(0, len(words) - _SHINGLE + 1))}


def workload_prompts(workloads: Path | None) -> list[str]:
    """Every prompt (and message content) of the workload files under ``workloads``."""
    if workloads is None or not Path(workloads).is_dir():
        return []
    out = []
    for path in sorted(Path(workloads).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if isinstance(row.get("prompt"), str):
                out.append(row["prompt"])
            for m in row.get("messages") or []:
                if isinstance(m, dict) and isinstance(m.get("content"), str):
                    out.append(m["content"])
    return out


def workload_overlap(workloads: Path | None) -> Callable[[str], bool]:
    """A test of whether a text equals a workload prompt or shares a run of ``_SHINGLE`` words with one."""
    held_out = workload_prompts(workloads)
    exact = {normalize(p) for p in held_out}
    shingles: set[tuple[str, ...]] = set().union(*(_shingles(p) for p in held_out)) if held_out else set()
    return lambda text: normalize(text) in exact or bool(_shingles(text) & shingles)


def _doc_passages(max_chars: int) -> list[tuple[str, str]]:
    """(name, passage) pairs from pydoc topics and module/function docstrings."""
    passages: list[tuple[str, str]] = []
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a trimmed Python without pydoc_data: docstrings only
        topics = {}
    for name, text in sorted(topics.items()):
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if len(para) >= 120:
                passages.append((name, para[:max_chars]))
    for mod_name in _MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            with warnings.catch_warnings():  # deprecated aliases (typing.io) warn when touched
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = getattr(getattr(mod, attr, None), "__doc__", None)
            if isinstance(doc, str) and len(doc) >= 80:
                passages.append((f"{mod_name}.{attr}", " ".join(doc.split())[:max_chars]))
    return passages


_WEAVE = ("chat", "docs", "chat", "json", "docs", "chat", "multilingual", "docs", "chat", "json")


def _sources(rng: random.Random, max_chars: int) -> dict[str, list[str]]:
    passages = _doc_passages(max_chars)
    rng.shuffle(passages)
    docs = [_TEMPLATES[i % len(_TEMPLATES)].format(name=name, text=text) for i, (name, text) in enumerate(passages)]
    chat = [task.format(s=subject) for subject in _CHAT_SUBJECTS for task in _CHAT_TASKS] + list(_CHAT_QUESTIONS)
    multilingual = [task.format(s=subject) for task, subjects in _MULTILINGUAL for subject in subjects]
    json_tasks = _json_prompts(rng, 2 * len(chat) // 3)
    for items in (chat, multilingual):
        rng.shuffle(items)
    return {"docs": docs, "chat": chat, "json": json_tasks, "multilingual": multilingual}


def build_prompts(workloads: Path | None = DEFAULT_WORKLOADS, *, limit: int | None = None, seed: int = 0,
                  max_chars: int = 600) -> list[str]:
    """Deterministic, deduplicated instructions from the four sources woven by ``_WEAVE`` (a source
    that runs out is skipped), none overlapping a workload prompt."""
    return [text for _, text in build_labelled_prompts(workloads, limit=limit, seed=seed, max_chars=max_chars)]


def build_labelled_prompts(workloads: Path | None = DEFAULT_WORKLOADS, *, limit: int | None = None, seed: int = 0,
                           max_chars: int = 600) -> list[tuple[str, str]]:
    """``build_prompts`` as (source, prompt) pairs: source one of chat, docs, json, multilingual."""
    overlaps = workload_overlap(workloads)
    sources = {name: iter(items) for name, items in _sources(random.Random(seed), max_chars).items()}
    seen: set[str] = set()
    prompts = []
    while sources and (limit is None or len(prompts) < limit):
        for name in _WEAVE:
            if name not in sources:
                continue
            prompt = next(sources[name], None)
            if prompt is None:
                del sources[name]
                continue
            key = normalize(prompt)
            if key in seen or overlaps(prompt):
                continue
            seen.add(key)
            prompts.append((name, prompt))
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


def weave(*lists: list) -> list:
    """Round robin over the lists: ``a[0], b[0], ..., a[1], b[1], ...``; a list that runs out drops
    out and the others go on."""
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        out += [x[i] for x in lists if i < len(x)]
    return out
