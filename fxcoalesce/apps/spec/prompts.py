"""Prompts for self-distillation and for measuring the draft head, built from templates and
topics shipped here: the same on every machine, offline, with no data set to fetch.

The target writes the responses (the draft learns the target's own distribution, so the
prompts only need to be varied, not curated). Held-out prompts use topics, templates and
coding tasks that training never sees.

    training_prompts()          ~19k prompts, shuffled (seeded)
    held_out_prompts(n)         the first n of a fixed shuffle of the held-out set
"""

from __future__ import annotations

import random

TEMPLATES = """\
Explain {t} in simple terms.
What is {t}?
Write a short paragraph about {t}.
Give me three interesting facts about {t}.
How does {t} work?
Why is {t} important?
Write a short poem about {t}.
Summarize the history of {t}.
What are the advantages and disadvantages of {t}?
Describe {t} to a ten-year-old.
Write a short story that involves {t}.
List five key terms related to {t} and define each.
What are common misconceptions about {t}?
How can I learn more about {t}?
Write a tweet about {t}.
Compare {t} with something similar and explain the differences.
What questions would an expert ask about {t}?
Give a step-by-step guide related to {t}.
Write an email to a friend about {t}.
What is the future of {t}?
Tell me a fun fact about {t}.
Write a haiku about {t}.
What role does {t} play in everyday life?
Create a quiz with three questions about {t}.
Explain {t} as if you were a teacher.
What are the main challenges related to {t}?
Write a product description inspired by {t}.
Give me a brief overview of {t}.
What should a beginner know about {t}?
Write a dialogue between two people discussing {t}.
Describe {t} in three sentences.
How has {t} changed over time?
What are some examples of {t}?
Write a persuasive paragraph about {t}.
What careers are related to {t}?
Explain the science behind {t}.
Write a limerick about {t}.
What are the ethical questions around {t}?
Suggest a weekend project involving {t}.
Write a news headline and a short article about {t}.""".splitlines()

HELD_OUT_TEMPLATES = """\
Can you teach me about {t}?
I am curious about {t}. Where should I start?
Write a short blog post about {t}.
What would happen if {t} disappeared?
Explain {t} using an analogy.
Give me a short summary of {t} for a presentation.
What are three tips related to {t}?
Describe a typical day involving {t}.""".splitlines()

TOPICS = """\
photosynthesis; black holes; the water cycle; volcanoes; earthquakes; plate tectonics;
the solar system; the moon; Mars; Jupiter; comets; the Big Bang; gravity; magnetism;
electricity; static electricity; light; rainbows; sound waves; the speed of light;
atoms; molecules; chemical reactions; acids and bases; the periodic table; carbon;
oxygen; hydrogen fuel; nuclear energy; solar power; wind turbines; batteries;
electric cars; recycling; composting; climate change; the ozone layer; rainforests;
deserts; coral reefs; oceans; glaciers; rivers; mountains; islands; wetlands;
bees; ants; butterflies; spiders; dolphins; whales; sharks; octopuses; penguins;
elephants; lions; tigers; wolves; dogs; cats; horses; owls; eagles; parrots; frogs;
dinosaurs; fossils; evolution; DNA; genes; cells; bacteria; viruses; vaccines;
the immune system; the human heart; the brain; sleep; dreams; memory; nutrition;
vitamins; exercise; yoga; meditation; stress; running; swimming; cycling; hiking;
football; basketball; tennis; chess; the Olympic Games; baseball; cricket; golf;
skateboarding; surfing; rock climbing; camping; fishing; gardening; houseplants;
tomatoes; apples; bananas; coffee; tea; chocolate; bread baking; pizza; pasta;
sushi; soup; salads; spices; vegetarian cooking; breakfast; fermentation; cheese;
ancient Egypt; the Roman Empire; ancient Greece; the Middle Ages; the Renaissance;
the Industrial Revolution; the printing press; the Silk Road; the Vikings; castles;
pyramids; the Great Wall of China; democracy; elections; human rights; the United Nations;
money; inflation; banks; taxes; budgeting; saving money; investing; the stock market;
cryptocurrency; small businesses; marketing; advertising; customer service; job interviews;
resumes; teamwork; leadership; public speaking; negotiation; time management;
productivity; procrastination; habits; motivation; goal setting; learning a language;
reading books; writing a novel; poetry; libraries; museums; painting; sculpture;
photography; film making; animation; music theory; the piano; the guitar; jazz;
classical music; hip hop; opera; dance; theater; comedy; video games; board games;
puzzles; magic tricks; origami; knitting; woodworking; pottery; fashion; architecture;
bridges; skyscrapers; trains; airplanes; ships; bicycles; traffic; cities; villages;
public transport; maps; GPS; the internet; email; social media; smartphones; computers;
programming; Python; JavaScript; databases; algorithms; sorting algorithms; recursion;
binary numbers; encryption; passwords; cybersecurity; artificial intelligence;
machine learning; robots; self-driving cars; drones; 3D printing; virtual reality;
cloud computing; open source software; operating systems; spreadsheets; version control;
mathematics; fractions; prime numbers; geometry; triangles; circles; probability;
statistics; algebra; calculus; infinity; the number zero; logic; philosophy; ethics;
happiness; friendship; kindness; gratitude; empathy; family traditions; holidays;
birthdays; weddings; festivals; New Year celebrations; volunteering; charity;
neighborhoods; pets; adopting a dog; training a puppy; aquariums; zoos; national parks;
travel; packing a suitcase; learning to drive; road trips; hotels; airports; passports;
weather; thunderstorms; snow; hurricanes; tornadoes; seasons; the sun; stars; telescopes;
astronauts; space stations; rockets; satellites; the history of flight; inventions;
Thomas Edison; Marie Curie; Albert Einstein; Isaac Newton; Leonardo da Vinci;
William Shakespeare; Ada Lovelace; Charles Darwin; Galileo; Nikola Tesla; the telephone;
radio; television; newspapers; journalism; podcasts; education; homework; exams;
online learning; teachers; universities; scholarships; science fairs; experiments;
the scientific method; critical thinking; curiosity; creativity; boredom; patience;
cooking rice; making pancakes; brewing coffee; cleaning a kitchen; doing laundry;
organizing a closet; moving house; renting an apartment; home repairs; painting a room;
energy saving at home; water conservation; plastic pollution; air pollution; deforestation;
endangered species; wildlife conservation; farming; organic food; irrigation; soil;
honey; milk; eggs; rice; wheat; corn; potatoes; salt; sugar; olive oil; mushrooms;
first aid; headaches; the common cold; allergies; hand washing; dental care; eyesight;
hearing; posture; walking; stretching; healthy snacks; drinking water; hospitals; doctors;
nurses; pharmacies; firefighters; police officers; lawyers; judges; engineers; architects;
chefs; farmers; pilots; scientists; artists; musicians; writers; teachers' jobs;
the human skeleton; muscles; blood; lungs; digestion; the skin; hair; emotions; laughter;
languages; grammar; punctuation; spelling; dictionaries; translation; sign language;
handwriting; calligraphy; typography; emojis; storytelling; fairy tales; myths; legends;
superheroes; science fiction; mystery novels; comics; cartoons; clowns; circuses; parks;
playgrounds; swimming pools; beaches; lighthouses; ports; canals; dams; tunnels; roads;
electric grids; water treatment; waste management; sewers; street lights; elevators;
escalators; clocks; calendars; time zones; leap years; the metric system; measurement;
thermometers; microscopes; magnets in daily life; glass; paper; cotton; wool; steel;
aluminum; gold; diamonds; crystals; rocks and minerals; caves; sand; clouds; fog; wind;
ocean tides; waves; tsunamis; the Arctic; Antarctica; the Amazon river; the Sahara;
the Himalayas; the Pacific Ocean; Africa; Asia; Europe; South America; Australia""".replace(
    "\n", " ").split("; ")

HELD_OUT_TOPICS = """\
jellyfish; the northern lights; lightning; tea ceremonies; submarines; hot air balloons;
windmills; the Moon landing; the Eiffel Tower; lemons; chess openings; bird migration;
sunflowers; earthworms; bamboo; sleep schedules; marathons; kites; snowflakes; rainwater;
beekeeping; the Olympic torch; sourdough; pirates; knights; trains in Japan;
public libraries; telescopes for amateurs; solar eclipses; thunder; ice cream;
vinegar; wind chimes; street food; family recipes; old maps; treasure hunts;
volunteer firefighters; sea turtles; mangroves; hummingbirds; coffee shops;
weather forecasts; paper airplanes; soap bubbles; fireworks; night skies; fountains""".replace(
    "\n", " ").split("; ")

CODE_TEMPLATES = """\
Write a Python function that {t}.
Write a Python function that {t}, and explain how it works.
Show me how to {t} in Python.""".splitlines()

CODE_TASKS = """\
reverses a string; checks whether a number is prime; computes the factorial of a number;
returns the n-th Fibonacci number; counts the vowels in a string; finds the largest element
of a list; removes duplicates from a list; sorts a list of dictionaries by a key;
merges two sorted lists; checks whether a string is a palindrome; computes the average of a
list of numbers; counts word frequencies in a text; converts Celsius to Fahrenheit;
flattens a nested list; finds the second largest number in a list; reads a text file and
counts its lines; writes a list of strings to a file; capitalizes every word in a sentence;
checks whether two strings are anagrams; computes the greatest common divisor of two numbers;
generates a random password; validates an email address with a regular expression;
finds all even numbers in a list; computes the sum of the digits of a number;
converts a decimal number to binary; implements binary search; implements bubble sort;
implements a stack class; implements a queue with two stacks; transposes a matrix;
multiplies two matrices; finds the intersection of two lists; rotates a list by k positions;
counts the occurrences of each character in a string; checks whether a year is a leap year;
returns the longest word in a sentence; computes compound interest; parses a date string;
groups a list of words by their first letter; finds the median of a list;
computes the dot product of two vectors; removes punctuation from a string;
splits a list into chunks of size n; checks whether a list is sorted; finds the mode of a
list; converts a dictionary to a list of tuples; inverts a dictionary; computes the power
set of a list; generates all permutations of a string; computes the n-th triangular
number; checks whether brackets in a string are balanced; sums the numbers in a CSV file;
builds a URL with query parameters; counts the words in a file;
returns the first non-repeated character of a string; converts a string to title case;
computes the area of a circle; computes the distance between two points; finds the
missing number in a list from 1 to n; zips two lists into a dictionary; filters a list of
strings by length; reverses the words of a sentence; computes the running total of a list;
clamps a number between two bounds; checks whether a number is a perfect square;
computes the least common multiple of two numbers; converts seconds to hours, minutes and
seconds; formats a number with thousands separators; truncates a string to n characters;
counts the lines of code in a Python file; finds duplicate files by size;
computes a moving average; normalizes a list of numbers to the range 0 to 1""".replace(
    "\n", " ").split("; ")

HELD_OUT_CODE_TASKS = """\
counts the uppercase letters in a string; returns the sum of squares of a list;
checks whether a string contains only digits; finds the smallest element of a list;
converts a list of strings to integers; returns the last n elements of a list;
replaces spaces with underscores in a string; computes the product of a list of numbers;
checks whether a number is even; finds the index of the maximum value in a list;
repeats a string n times with a separator; returns the unique words of a sentence""".replace(
    "\n", " ").split("; ")


def _fill(templates: list[str], topics: list[str]) -> list[str]:
    return [t.format(t=topic) for t in templates for topic in topics]


def training_prompts(seed: int = 0) -> list[str]:
    """Every training template with every training topic, and the coding prompts, shuffled."""
    prompts = _fill(TEMPLATES, TOPICS) + _fill(CODE_TEMPLATES, CODE_TASKS)
    random.Random(seed).shuffle(prompts)
    return prompts


def held_out_prompts(n: int | None = None) -> list[str]:
    """Held-out templates with held-out topics, and held-out coding tasks (one coding prompt
    in eight), in a fixed order; the first ``n``."""
    prose = _fill(HELD_OUT_TEMPLATES, HELD_OUT_TOPICS)
    code = _fill(CODE_TEMPLATES, HELD_OUT_CODE_TASKS)
    random.Random(1).shuffle(prose)
    random.Random(2).shuffle(code)
    mixed = [code.pop() if i % 8 == 7 and code else prose.pop() for i in range(len(prose))]
    return mixed[:n]
