"""A small English text (written for this project) on which the synthetic checkpoints' BPE tokenizer is trained."""

TEXT = """\
The harbour town woke slowly that morning. Fog lay over the water, and the fishing boats came home one by one,
their lights blinking through the grey like tired stars. Anna stood at the end of the pier with her father's old
notebook under her arm. She had promised herself that she would read it before the summer was over, and the summer
was nearly over now.

The first page held a list of numbers: 3, 14, 15, 92, 65, 358, 979. Beside them, in small careful letters, her
father had written "not a code, just the tide". She laughed, because it was exactly the kind of joke he used to
make. The second page was a drawing of a lighthouse, and the third was a recipe for bread that needed 500 grams of
flour, 350 millilitres of water, 10 grams of salt and a great deal of patience.

"Are you coming in?" called Mr. Patel from the door of the bakery. "It's cold, and I've just made tea."
"I'll be there in a minute," she answered. "I want to watch the last boat."
"You said that yesterday, and the day before. Don't stay out too long; the wind is turning."

Inside, the bakery smelled of butter and smoke. A radio on the shelf was reading the weather: light rain in the
north, strong winds along the coast, temperatures between 8 and 12 degrees. Mr. Patel poured two cups and pushed
a plate of warm rolls across the counter. They talked about the harbour, about the new school that was being built
on the hill, and about the storm of 1987, which everyone in the town still remembered.

Computers are machines that follow instructions. A program is a list of those instructions, written in a language
that people can read and that the machine can translate into simple steps. Some programs add numbers; others draw
pictures, play music, or predict the next word in a sentence. A language model is a program of the last kind: it
reads a sequence of tokens and estimates, for every token in its vocabulary, how likely that token is to come next.

To build such a model, engineers first choose a tokenizer. A tokenizer splits text into pieces. Byte pair encoding
starts from single bytes and repeatedly merges the most frequent pair of neighbouring pieces into a new piece, until
the vocabulary reaches the size that was asked for. Common words such as "the", "and" and "of" become single tokens
quickly, while rare words are spelled out from smaller parts.

The model itself is a stack of layers. Each layer reads the hidden state of every position, mixes information between
positions with attention, and then transforms each position on its own with a feed-forward network. In a mixture of
experts, that network is replaced by many smaller networks, the experts, and a router chooses a few of them for each
token. Only the chosen experts run, which keeps the cost low even when the total number of parameters is very large.

Attention compares a query with every key that came before it. When the context is long, that comparison becomes
expensive, so sparse attention first uses a cheap indexer to score all earlier positions and then attends only to
the best ones. The indexer must be fast, and its choices must be stable: if two positions receive exactly the same
score, different programs may break the tie in different ways and produce different answers.

Weights are usually stored with fewer bits than they were trained with. A quantized tensor is cut into blocks; each
block keeps a scale and a set of small integers, and the reader multiplies them back together when it needs the
values. Four bits per weight are often enough, although the most sensitive tensors are kept at six or eight bits.

def greet(name):
    message = "Hello, " + name + "!"
    print(message)
    return len(message)

for i in range(10):
    total = total + i * 2

if value > 100 and count < 5:
    result = [x for x in items if x % 2 == 0]

Anna finished her tea and opened the notebook again. On the last page, under a date from twenty years ago, her
father had written a single sentence: "The sea is patient, and so should you be." She closed the book, thanked
Mr. Patel, and walked back along the harbour while the fog lifted and the first light of the afternoon touched the
water. Somewhere behind her the last boat was coming in, slow and steady, exactly on time.

Questions for the reader: What did the list of numbers mean? Why did Anna wait on the pier? Would you have read
the notebook sooner, or later? Write your answers in two or three sentences, and compare them with a friend's.

Spring, summer, autumn and winter; morning, noon, evening and night; north, south, east and west. One, two, three,
four, five, six, seven, eight, nine, ten, eleven, twelve. January, February, March, April, May, June, July, August,
September, October, November, December. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
"""
