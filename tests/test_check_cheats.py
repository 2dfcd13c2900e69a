"""``python -m minidist check NN`` cannot be fooled by a line or two: each variant below passed
chapters 07-18 with a wrong or empty answer before the runner ran the checks itself (issue 18),
and must fail now, with a message that says what was caught. The honest solution passes and
the untouched exercise fails (``test_exercises.py`` proves both for every chapter).

The variants: a learner's ``get_ipython().set_custom_exc(...)`` (every later error swallowed,
so nbval saw no failure); a check function (or the checks' ``on_sim``) replaced by a lambda; the
check cells edited or deleted; ``os._exit(0)`` in the mpirun script (every rank exits 0 before
any check runs); the script's own checks replaced at its top; the engine's (or the checks')
implementation handed in as the answer, or called by it; and, for chapters 16-18, answers that
lean on the checks themselves: the check's own helper for the mesh's lines, a sum taken from the
checks' reference (no message sent), the checks' expected parts, a sampler position kept in a
class attribute rather than in its state, and a check's own constant changed by the learner's
function while the check runs; and, for any chapter (08's notebook, 07's script), a right answer
that rebinds a numpy function while the check runs (the runner restores names between cells and
fails a cell during which they changed: ``grading.Snapshot.changed``); and (issue 36) shortcuts
that would not work under mpiexec or beside memory.track: 13's puzzle with gradients cached by
an untracked first call or computed in another thread, 14's g drawing the other ranks' inputs
again from the check's seeds, 15's gradients passed through memory the simulated ranks share,
drawn again from the check's seeds or the checks' reference returned with the right traffic,
and numpy's ``numpy._core.numeric.isclose`` rebound in an answer cell (np.allclose always true)."""
from pathlib import Path

import nbformat
import pytest

from minidist.course import exercises, runner

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.mpi]

CUSTOM_EXC = "get_ipython().set_custom_exc((BaseException,), lambda *args, **kwargs: None)"


def chapter_files(nn: str, kind: str) -> dict[str, str]:
    """Chapter ``nn``'s files as the learner gets them (``kind="exercise"``) or solved."""
    files = {}
    for path in exercises.solution_files(ROOT, [nn]):
        files[path.name] = exercises.render_exercise(path) if kind == "exercise" else path.read_text()
    return files


def code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def stub_cells(nb):
    return [cell for cell in code_cells(nb) if exercises.is_stub(cell.source)]


def edit_notebook(text: str, edit) -> str:
    nb = nbformat.reads(text, as_version=4)
    edit(nb)
    return nbformat.writes(nb)


def cell_with(nb, fragment: str):
    """The one code cell whose source contains ``fragment``."""
    found = [cell for cell in code_cells(nb) if fragment in cell.source]
    assert len(found) == 1, (fragment, len(found))
    return found[0]


def replace_in(cell, old: str, new: str, count: int = 1):
    assert cell.source.count(old) >= count, (old, cell.source)
    cell.source = cell.source.replace(old, new)


def notebook_of(files):
    return next(name for name in files if name.endswith(".ipynb"))


def script_of(files):
    return next(name for name in files if name.endswith(".py"))


# ----------------------------------------------------------------------------- the answers a cheat hides

WRONG_07 = "grad = np.asarray(1.0 / m)"  # in the solution; the cheats start from grad = 1 (m times too large)
STUB_BODY = "    # YOUR CODE HERE\n    raise NotImplementedError()"

WRONG_08 = "    return gpipe(num_stages, num_microbatches)[rank]  # GPipe's order, not 1F1B's"
WRONG_11 = "        return not found_inf  # a static scale"

WRONG_STASH = '''class Stash:
    def __init__(self):
        self.saved = {}

    def save(self, microbatch, version, weights):
        self.saved[microbatch] = (version, weights)  # no copies: the latest weights come back

    def load(self, microbatch):
        return self.saved.pop(microbatch)

    def __len__(self):
        return len(self.saved)'''

WRONG_CHECKPOINT = '''class Checkpoint(Function):
    @staticmethod
    def forward(ctx, x, function):
        ctx.inp = Tensor(x, requires_grad=True)
        ctx.out = function(ctx.inp)  # keeps the whole graph: no memory saved
        return ctx.out.data

    @staticmethod
    def backward(ctx, grad):
        ctx.out.backward(grad)
        return (ctx.inp.grad,)


def checkpoint(function, x):
    return Checkpoint.apply(x, function=function)'''

WRONG_LAYER_NORM = '''class LayerNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps=1e-5):
        mean = x.mean(axis=-1, keepdims=True)
        rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return (x - mean) * rstd * weight + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, rstd = ctx.saved
        n = (x - mean) * rstd
        leading = tuple(range(x.ndim - 1))
        return rstd * grad * weight, (grad * n).sum(axis=leading), grad.sum(axis=leading)  # no 1/N terms


def layer_norm(x, weight, bias, eps=1e-5):
    return LayerNorm.apply(x, weight, bias, eps=eps)'''

WRONG_REDUCE_FROM = '''class ReduceFrom(Function):
    @staticmethod
    def forward(ctx, x, *, comm):
        ctx.comm = comm
        return all_reduce(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return (all_reduce(ctx.comm, grad),)  # summed again: T times too large'''

WRONG_ZERO1 = '''def zero1_step(comm, w, g, update, state):
    p, rank, n = comm.Get_size(), comm.Get_rank(), w.size
    s = -(-n // p)
    pad = np.zeros(p * s - n)
    g_mine = reduce_scatter(comm, np.concatenate([g, pad]))  # the sum, not the mean
    new = update(np.concatenate([w, pad])[rank * s:(rank + 1) * s], g_mine, state)
    return all_gather(comm, new).reshape(-1)[:n]'''

WRONG_HIERARCHICAL = '''def hierarchical_all_reduce(comm, x, ranks_per_node):
    return all_reduce(comm, x, algorithm="ring")  # a flat ring: every step at the network's speed'''

WRONG_RESHARD = '''def reshard(pieces, numel, world_size, rank):
    size = -(-numel // world_size)
    glued = np.concatenate([p["values"] for p in pieces] + [np.zeros(size * world_size)])
    return glued[rank * size : (rank + 1) * size]  # the saved padding comes along'''

WRONG_SAMPLER = '''class ElasticSampler:
    def __init__(self, num_samples, global_batch_size, world_size, rank, seed=0):
        self.n, self.G, self.M, self.rank, self.seed = num_samples, global_batch_size, world_size, rank, seed
        self.step = 0

    def next_indices(self):
        batch = np.random.default_rng([self.seed, 0]).permutation(self.n)[self.step * self.G : (self.step + 1) * self.G]
        self.step += 1
        return batch[self.rank * (self.G // self.M) : (self.rank + 1) * (self.G // self.M)]  # the remainder dropped

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]'''

WRONG_16 = """    table = {"dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
             "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}  # the 2 x 2 x 2 groups, hard-coded
    rank = comm.Get_rank()
    return {name: comm.Split(color=next(i for i, line in enumerate(lines) if rank in line), key=rank)
            for name, lines in table.items()}"""

WRONG_SAVE = '''def save_checkpoint(path, state):
    np.savez(open(path, "wb"), **state)  # in place: a kill leaves half a file'''

WRONG_LOAD = '''def load_latest(directory):
    names = sorted(os.listdir(directory))
    return dict(np.load(os.path.join(directory, names[-1]))) if names else None  # no skipping'''


def wrong_answer(nn: str, nb) -> None:
    """Replace chapter ``nn``'s stubs in ``nb`` with a wrong answer that runs."""
    if nn == "07":
        solved = nbformat.reads(chapter_files("07", "solution")[notebook_of(chapter_files("07", "solution"))],
                                as_version=4)
        cell = stub_cells(nb)[0]
        cell.source = cell_with(solved, "### BEGIN SOLUTION").source.replace(WRONG_07, "grad = np.asarray(1.0)")
        cell.source = "\n".join(line for line in cell.source.splitlines() if "### " not in line)
    elif nn == "08":
        replace_in(stub_cells(nb)[0], STUB_BODY, WRONG_08)
    elif nn == "11":
        replace_in(stub_cells(nb)[0], STUB_BODY.replace("    ", "        "), WRONG_11)
    elif nn == "09":
        stub_cells(nb)[0].source = WRONG_STASH
    elif nn == "10":
        stub_cells(nb)[0].source = WRONG_CHECKPOINT
    elif nn == "12":
        save, load = stub_cells(nb)
        save.source, load.source = WRONG_SAVE, WRONG_LOAD
    elif nn == "13":
        stub_cells(nb)[0].source = WRONG_LAYER_NORM
    elif nn == "14":
        stub_cells(nb)[0].source = WRONG_REDUCE_FROM
    elif nn == "15":
        stub_cells(nb)[0].source = WRONG_ZERO1
    elif nn == "16":
        replace_in(stub_cells(nb)[0], STUB_BODY, WRONG_16)
    elif nn == "17":
        stub_cells(nb)[0].source = WRONG_HIERARCHICAL
    elif nn == "18":
        reshard, sampler = stub_cells(nb)
        reshard.source, sampler.source = WRONG_RESHARD, WRONG_SAMPLER


# ----------------------------------------------------------------------------- the variants

def custom_exc(nn):
    """The untouched exercise, its first stub cell opening with set_custom_exc; a script stays solved."""
    def build(files):
        def edit(nb):
            cell = stub_cells(nb)[0]
            cell.source = CUSTOM_EXC + "\n" + cell.source
        files[notebook_of(files)] = edit_notebook(files[notebook_of(files)], edit)
    return build


PATCHES = {
    "07": "pipeline_checks.on_sim = lambda *args, **kwargs: 'ok'\n"
          "checks.check_close = lambda *args, **kwargs: None",
    "08": "schedule_checks.check_one_f_one_b_order = lambda fn: 'ok'",
    "09": "pipedream_checks.check_stash = lambda cls: 'ok'",
    "10": "memory_checks.check_checkpoint = lambda fn: 'ok'",
    "11": "precision_checks.check_loss_scaler = lambda cls: 'ok'",
    "12": "fault_checks.check_atomic_save = fault_checks.check_load_latest = fault_checks.check_fault_tolerance = "
          "lambda *args: 'ok'",
    "13": "transformer_checks.check_layer_norm = lambda fn: 'ok'",
    "14": "tp_checks.check_reduce_from = tp_checks.check_row_parallel_linear = lambda cls: 'ok'",
    "15": "sharding_checks.check_zero1_step = lambda fn: 'ok'",
    "16": "mesh_checks.check_build_groups = lambda fn: 'ok'",
    "17": "topology_checks.check_hierarchical_all_reduce = lambda fn: 'ok'",
    "18": "elastic_checks.check_reshard = elastic_checks.check_elastic_sampler = "
          "elastic_checks.check_elastic_training = lambda *args: 'ok'",
}


def patch_check(nn):
    """A wrong answer, and the check it would fail replaced by a lambda in the answer cell."""
    def build(files):
        def edit(nb):
            wrong_answer(nn, nb)
            cell = stub_cells(nbformat.reads(chapter_files(nn, "exercise")[notebook_of(files)], as_version=4))[0]
            mine = next(c for c in code_cells(nb) if c.source.split("\n")[0] == cell.source.split("\n")[0])
            mine.source += "\n\n\n" + PATCHES[nn]
        files[notebook_of(files)] = edit_notebook(files[notebook_of(files)], edit)
    return build


CHECK_CELLS = {  # chapter -> fragments of the check cells a learner edits away
    "07": ["pipeline_checks.on_sim(pipeline_checks.check_gpipe_stage_step", "checks.check_close(yours[-1][0]"],
    "08": ["print(schedule_checks.check_one_f_one_b_order(one_f_one_b_order))"],
    "09": ["print(pipedream_checks.check_stash(Stash))"],
    "10": ["print(memory_checks.check_checkpoint(checkpoint))"],
    "11": ["print(precision_checks.check_loss_scaler(LossScaler))"],
    "12": ["fault_checks.check_atomic_save(save_checkpoint)\nprint", "fault_checks.check_load_latest(save_checkpoint",
           "print(fault_checks.check_fault_tolerance("],
    "14": ["print(tp_checks.check_reduce_from(ReduceFrom))",
           "print(tp_checks.check_row_parallel_linear(RowParallelLinear))",
           "print(sp_checks.check_sequence_operators(", "print(sp_checks.check_sequence_parallel_mlp("],
    "15": ["print(sharding_checks.check_zero1_step(zero1_step))",
           "print(full_shard_checks.check_full_shard_step(full_shard_step))"],
    "18": ["print(elastic_checks.check_reshard(reshard))", "print(elastic_checks.check_elastic_sampler(",
           "print(elastic_checks.check_elastic_training("],
}


def edit_check_cells(nn, delete: bool):
    """A wrong answer, and the check cells deleted, or their check calls turned into a print."""
    def build(files):
        def edit(nb):
            wrong_answer(nn, nb)
            for fragment in CHECK_CELLS[nn]:
                cell = cell_with(nb, fragment)
                if delete:
                    nb.cells.remove(cell)
                else:
                    cell.source = "\n".join("# " + line for line in cell.source.splitlines())
        files[notebook_of(files)] = edit_notebook(files[notebook_of(files)], edit)
    return build


def solved_notebook_and_script(script_edit):
    """Exercise 07 with the notebook solved and the mpirun script's stub replaced by a cheat."""
    def build(files):
        files[notebook_of(files)] = chapter_files("07", "solution")[notebook_of(files)]
        files[script_of(files)] = script_edit(chapter_files("07", "exercise")[script_of(files)])
    return build


def changed_while_it_runs(nn):
    """Chapter ``nn`` solved, its answer right, but the learner's function rebinds a name of numpy
    the checks read, each time it is called (the runner's guard, ``grading.Snapshot.changed``,
    must catch it whichever check the chapter has: 08's notebook, 07's mpirun script)."""
    patch = "    __import__('numpy').array_equal = lambda *args, **kwargs: True\n"

    def build(files):
        solved = chapter_files(nn, "solution")
        if nn == "07":  # the script: the solved function's first line
            files[notebook_of(files)] = solved[notebook_of(files)]
            head = "    ### BEGIN SOLUTION\n"
            assert solved[script_of(files)].count(head) == 1
            files[script_of(files)] = solved[script_of(files)].replace(head, head + patch)
            return

        def edit(nb):
            cell = cell_with(nb, "### BEGIN SOLUTION")
            replace_in(cell, "    ### BEGIN SOLUTION\n", "    ### BEGIN SOLUTION\n" + patch)
        files[notebook_of(files)] = edit_notebook(solved[notebook_of(files)], edit)
    return build


def os_exit(script: str) -> str:
    assert "    raise NotImplementedError()" in script
    return script.replace("    raise NotImplementedError()", '    __import__("os")._exit(0)')


def script_patch(script: str) -> str:
    top = "from minidist.course.checks import pipeline as pipeline_checks\n"
    assert top in script
    return script.replace(top, top + "pipeline_checks.check_gpipe_stage_step = lambda comm, fn: 'ok'\n")


def engine(nn):
    """The engine's (or the checks' own) implementation as the answer, or called by it."""
    answers = {
        "08": (STUB_BODY, "    from minidist.parallel.pipeline.schedules import one_f_one_b\n"
                          "    return one_f_one_b(num_stages, num_microbatches)[rank]"),
        "08-order": (STUB_BODY, "    from minidist.parallel.pipeline import schedules\n"
                                "    return schedules.one_f_one_b_order(rank, num_microbatches, "
                                "min(num_microbatches, num_stages - rank))"),
        "10": ("    return Checkpoint.apply(x, function=function)",
               "    return Checkpoint.apply(x, function=function)\n\n\n"
               "from minidist.recompute import checkpoint  # noqa: E402, F811"),
        "11": ("        raise NotImplementedError()",
               "        raise NotImplementedError()\n\n\nLossScaler = precision_checks.ReferenceScaler"),
        "13": ("    return LayerNorm.apply(x, weight, bias, eps=eps)",
               "    return F.layer_norm(x, x.shape[-1], weight, bias, eps)  # the engine's op, called"),
        "14": ("        # YOUR CODE HERE\n        raise NotImplementedError()\n\n    @staticmethod",
               "        return operators.ReduceFromTensorParallelRegion.forward(ctx, x, comm=comm)  # called\n\n"
               "    @staticmethod"),
        "14-class": ("        # YOUR CODE HERE\n        raise NotImplementedError()\n\n    @staticmethod",
                     "        pass\n\n    @staticmethod"),
        "15": (STUB_BODY, "    from minidist.nn import Parameter\n"
                          "    from minidist.optim import SGD\n"
                          "    from minidist.parallel.zero import ZeroRedundancyOptimizer\n\n"
                          "    shard = Parameter(w.copy())\n"
                          "    shard.grad = g\n"
                          "    ZeroRedundancyOptimizer([shard], SGD, comm, lr=0.1).step()\n"
                          "    return shard.data"),
        "16": (STUB_BODY, "    from minidist.parallel.mesh import DeviceMesh\n\n"
                          "    mesh = DeviceMesh(comm, shape, ('dp', 'pp', 'tp'))\n"
                          "    return {name: mesh.get_group(name) for name in ('dp', 'pp', 'tp')}"),
        "17": (STUB_BODY, '    return all_reduce(comm, x, algorithm="hierarchical")'),
        "18": (STUB_BODY, "    from minidist import resharding\n\n"
                          "    size = -(-numel // world_size)\n"
                          "    parts = [{'x': p['values'], 'shards': [{'path': ['x'], 'numel': numel, "
                          "'offset': p['offset'], 'length': p['length']}]} for p in pieces]\n"
                          "    return resharding.assemble(parts, ['x'], numel, rank * size, size)"),
    }
    if nn == "12":
        return engine_save_and_load

    def build(files):
        old, new = answers[nn]

        def edit(nb):
            cell = stub_cells(nb)[0]
            replace_in(cell, old, new)
            if nn.startswith("14"):  # the engine's operators imported in the answer cell
                cell.source = "from minidist.parallel.tensor_parallel import operators\n\n\n" + cell.source
            if nn == "14-class":  # the engine's g handed in as the answer
                cell.source += "\n\n\nReduceFrom = operators.ReduceFromTensorParallelRegion"
        files[notebook_of(files)] = edit_notebook(files[notebook_of(files)], edit)
    return build


ENGINE_SAVE = """def save_checkpoint(path, state):
    from minidist import checkpoint_io

    checkpoint_io.save_checkpoint(path, state)"""
ENGINE_LOAD = """def load_latest(directory):
    from minidist import checkpoint_io

    found = checkpoint_io.latest_valid_checkpoint(directory)
    return None if found is None else found[1]"""


def engine_save_and_load(files):
    def edit(nb):
        save, load = stub_cells(nb)
        save.source, load.source = ENGINE_SAVE, ENGINE_LOAD
    files[notebook_of(files)] = edit_notebook(files[notebook_of(files)], edit)


SHARED_POSITION = '''class ElasticSampler:
    steps = {}  # the position of every sampler of the process, not in the state

    def __init__(self, num_samples, global_batch_size, world_size, rank, seed=0):
        self.n, self.G, self.M, self.rank, self.seed = num_samples, global_batch_size, world_size, rank, seed
        ElasticSampler.steps.setdefault((global_batch_size, seed), 0)

    def next_indices(self):
        epoch, step = divmod(ElasticSampler.steps[self.G, self.seed], self.n // self.G)
        batch = np.random.default_rng([self.seed, epoch]).permutation(self.n)[step * self.G : (step + 1) * self.G]
        if self.rank == self.M - 1:
            ElasticSampler.steps[self.G, self.seed] += 1
        return np.array_split(batch, self.M)[self.rank]

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass'''


def leaning_on_the_checks(nn):
    """Chapter ``nn`` solved but for one answer that takes its result from the checks' module."""
    def build(files):
        solved = chapter_files(nn[:2], "solution")

        def edit(nb):
            if nn == "16":
                cell = cell_with(nb, "def build_groups(comm, shape):")
                cell.source = ("def build_groups(comm, shape):\n    rank = comm.Get_rank()\n"
                               "    return {name: comm.Split(next(i for i, line in enumerate("
                               "mesh_checks.lines(shape, d)) if rank in line), rank)\n"
                               "            for d, name in enumerate(mesh_checks.NAMES)}")
            elif nn == "17":
                cell = cell_with(nb, "def hierarchical_all_reduce(comm, x, ranks_per_node):")
                cell.source = ("def hierarchical_all_reduce(comm, x, ranks_per_node):\n"
                               "    return topology_checks.reference(comm.Get_size(), x.size)")
            elif nn == "17-slack":  # a flat ring, and the check's slack changed while the check runs
                cell = cell_with(nb, "def hierarchical_all_reduce(comm, x, ranks_per_node):")
                cell.source = ("def hierarchical_all_reduce(comm, x, ranks_per_node):\n"
                               "    topology_checks.SLACK = 1e9\n"
                               "    return all_reduce(comm, x, algorithm='ring')")
            elif nn == "18":
                cell = cell_with(nb, "class ElasticSampler:")
                cell.source = SHARED_POSITION
            else:
                cell = cell_with(nb, "def next_indices(self):")
                replace_in(cell, "        return np.array_split(batch, self.world_size)[self.rank]",
                           "        return elastic_checks.expected_parts(self.num_samples, G, self.world_size, "
                           "self.seed, self.epoch, self.global_samples // G - 1)[self.rank]")
        files[notebook_of(files)] = edit_notebook(solved[notebook_of(files)], edit)
    return build


PUZZLE_17 = {  # chapter 17's puzzle (one network card per node) answered by a cheat, the rest solved
    "engine": "    return all_reduce(comm, x, algorithm='hierarchical')",
    "three-phases": "    return hierarchical_all_reduce(comm, x, ranks_per_node)  # part one's answer, on one card",
    "target": ("    topology_checks.TARGET_FRACTION = 1e9  # the target moved while the check runs\n"
               "    return hierarchical_all_reduce(comm, x, ranks_per_node)"),
    "patched": ("    return all_reduce(comm, x, algorithm='ring')\n\n\n"
                "topology_checks.check_shared_card_all_reduce = lambda fn: 'ok'"),
}


SHARED_SUM_17 = """_BOARD = {}


def hierarchical_all_reduce(comm, x, ranks_per_node):
    # the vectors left where the simulated ranks' threads can read them; for the look of the traffic, the
    # three phases' bytes (n inside the node, 2(N-1)/N n/l across), whose arrivals are never read
    p, rank, l = comm.Get_size(), comm.Get_rank(), ranks_per_node
    _BOARD[(p, x.size, rank)] = x.copy()
    first, local = rank - rank % l, rank % l
    comm.Sendrecv(x.copy(), dest=first + (local + 1) % l, recvbuf=np.empty_like(x), source=first + (local - 1) % l)
    across = x[: round(2 * (p // l - 1) / (p // l) * x.size / l)].copy()
    comm.Sendrecv(across, dest=(rank + l) % p, recvbuf=np.empty_like(across), source=(rank - l) % p)
    comm.Barrier()
    total = np.sum([_BOARD[(p, x.size, r)] for r in range(p)], axis=0)
    comm.Barrier()
    return total
"""


def shared_memory_17(files):
    """Chapter 17 solved but for part one's answer: a sum through the sim's shared memory plus one
    Sendrecv of a vector's size (passed ``check`` before issue 36)."""
    solved = chapter_files("17", "solution")

    def edit(nb):
        cell_with(nb, "def hierarchical_all_reduce(comm, x, ranks_per_node):").source = SHARED_SUM_17
    files[notebook_of(files)] = edit_notebook(solved[notebook_of(files)], edit)


def puzzle_17(kind):
    """Chapter 17 solved, but for the puzzle's answer: ``PUZZLE_17[kind]``."""
    def build(files):
        solved = chapter_files("17", "solution")

        def edit(nb):
            cell = cell_with(nb, "def shared_card_all_reduce(comm, x, ranks_per_node):")
            cell.source = "def shared_card_all_reduce(comm, x, ranks_per_node):\n" + PUZZLE_17[kind]
        files[notebook_of(files)] = edit_notebook(solved[notebook_of(files)], edit)
    return build


UNSUMMED_BLOCK_14 = """class SequenceParallelMLP(nn.Module):
    def __init__(self, dense, comm):
        super().__init__()
        self.comm = comm
        self.start, self.stop = chunk_bounds(dense.fc1.out_features, comm.Get_size())[comm.Get_rank()]
        rows = slice(self.start, self.stop)
        self.ln = dense.ln  # whole, and its gradient a part on each rank: never summed
        self.fc1_weight = nn.Parameter(dense.fc1.weight.data[rows].copy())
        self.fc1_bias = nn.Parameter(dense.fc1.bias.data[rows].copy())
        self.fc2_weight = nn.Parameter(dense.fc2.weight.data[:, rows].copy())
        self.fc2_bias = nn.Parameter(dense.fc2.bias.data.copy())

    def forward(self, x):
        h = GatherSequence.apply(self.ln(x), comm=self.comm)
        h = F.gelu(h @ self.fc1_weight.transpose(1, 0) + self.fc1_bias, approximate="tanh")
        return x + ReduceScatterSequence.apply(h @ self.fc2_weight.transpose(1, 0), comm=self.comm) + self.fc2_bias"""

SHARED_SUMS_14 = """_BOARD, _COUNT = {}, {}  # every simulated rank is a thread of this process


class SharedSum(Function):  # the parts added on a board the threads share; an all-reduce of zeros for the look
    @staticmethod
    def forward(ctx, x, *, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        p, rank = ctx.comm.Get_size(), ctx.comm.Get_rank()
        n = _COUNT[p, rank] = _COUNT.get((p, rank), -1) + 1
        _BOARD.setdefault((p, n), {})[rank] = grad.copy()
        all_reduce(ctx.comm, np.zeros_like(grad))
        return (sum(_BOARD[p, n][r] for r in range(p)),)


class SequenceParallelMLP(nn.Module):
    def __init__(self, dense, comm):
        super().__init__()
        self.comm = comm
        self.start, self.stop = chunk_bounds(dense.fc1.out_features, comm.Get_size())[comm.Get_rank()]
        rows = slice(self.start, self.stop)
        self.ln_weight = nn.Parameter(dense.ln.weight.data.copy())
        self.ln_bias = nn.Parameter(dense.ln.bias.data.copy())
        self.fc1_weight = nn.Parameter(dense.fc1.weight.data[rows].copy())
        self.fc1_bias = nn.Parameter(dense.fc1.bias.data[rows].copy())
        self.fc2_weight = nn.Parameter(dense.fc2.weight.data[:, rows].copy())
        self.fc2_bias = nn.Parameter(dense.fc2.bias.data.copy())

    def forward(self, x):
        ln_weight, ln_bias, fc2_bias = (SharedSum.apply(q, comm=self.comm)
                                        for q in (self.ln_weight, self.ln_bias, self.fc2_bias))
        h = GatherSequence.apply(F.layer_norm(x, x.shape[-1], ln_weight, ln_bias), comm=self.comm)
        h = F.gelu(h @ self.fc1_weight.transpose(1, 0) + self.fc1_bias, approximate="tanh")
        return x + ReduceScatterSequence.apply(h @ self.fc2_weight.transpose(1, 0), comm=self.comm) + fc2_bias"""

PUZZLE_14 = {  # chapter 14's puzzle (sequence parallelism) answered by a cheat, the rest solved
    "patched": UNSUMMED_BLOCK_14 + "\n\n\nsp_checks.check_sequence_parallel_mlp = lambda cls: 'ok'",
    "engine-layer-norm": UNSUMMED_BLOCK_14.replace(
        "        self.ln = dense.ln  # whole, and its gradient a part on each rank: never summed",
        "        from minidist.parallel.tensor_parallel.gpt import SequenceParallelLayerNorm\n\n"
        "        self.ln = SequenceParallelLayerNorm(dense.ln, comm)  # the engine's"),
    "shared-sums": SHARED_SUMS_14,
    "dense-kept": """class SequenceParallelMLP(nn.Module):
    def __init__(self, dense, comm):
        super().__init__()
        self.comm, self.dense = comm, dense  # the whole block on every rank

    def forward(self, x):
        n = x.shape[0] * x.shape[1] * x.shape[2]  # the traffic of g and ḡ, for the look of it
        for _ in range(2):
            all_gather(self.comm, np.zeros(n))
        return self.dense(x)""",
}


def puzzle_14(kind):
    """Chapter 14 solved, but for the puzzle's block: ``PUZZLE_14[kind]``."""
    def build(files):
        solved = chapter_files("14", "solution")

        def edit(nb):
            cell_with(nb, "\nclass SequenceParallelMLP(nn.Module):").source = PUZZLE_14[kind]
        files[notebook_of(files)] = edit_notebook(solved[notebook_of(files)], edit)
    return build


KEEP_GATHERED_15 = """def full_shard_step(comm, model, shards, x, dy, update, states):
    p = comm.Get_size()
    whole = [all_gather(comm, s).reshape(-1)[:u.numel] for s, u in zip(shards, model.units)]  # kept to the end
    h, saved = x, []
    for unit, w in zip(model.units, whole):
        h, s = unit.forward(w, h)
        saved.append(s)
    grad = dy
    for i in reversed(range(len(model.units))):
        grad, grad_flat = model.units[i].backward(whole[i], saved[i], grad)
        padded = np.concatenate([grad_flat, np.zeros(p * shards[i].size - grad_flat.size)])
        shards[i] = update(shards[i], reduce_scatter(comm, padded) / p, states[i])
    for i in range(len(model.units)):  # the bytes of the second all-gather, for the look of it
        all_gather(comm, shards[i])
    return h"""

SHARED_15 = """_BOARD = {}  # every simulated rank is a thread of this process


def full_shard_step(comm, model, shards, x, dy, update, states):
    p, rank = comm.Get_size(), comm.Get_rank()
    key = (p, len(states[0]) and states[0]["t"])

    def whole(i):  # the other ranks' shards read from the board; the all-gather only for the traffic
        _BOARD[key, rank, i] = shards[i].copy()
        all_gather(comm, np.zeros_like(shards[i]))
        return np.concatenate([_BOARD[key, r, i] for r in range(p)])[:model.units[i].numel]

    h, saved = x, []
    for i, unit in enumerate(model.units):
        h, s = unit.forward(whole(i), h)
        saved.append(s)
    grad = dy
    for i in reversed(range(len(model.units))):
        grad, grad_flat = model.units[i].backward(whole(i), saved[i], grad)
        padded = np.concatenate([grad_flat, np.zeros(p * shards[i].size - grad_flat.size)])
        shards[i] = update(shards[i], reduce_scatter(comm, padded) / p, states[i])
    return h"""

SHARED_GRADIENTS_15 = """_BOARD, _COUNT = {}, {}  # every simulated rank is a thread of this process


def full_shard_step(comm, model, shards, x, dy, update, states):
    p, rank = comm.Get_size(), comm.Get_rank()
    h, saved = x, []
    for i, unit in enumerate(model.units):
        h, s = unit.forward(all_gather(comm, shards[i]).reshape(-1)[:unit.numel], h)
        saved.append(s)
    grad = dy
    for i in reversed(range(len(model.units))):
        grad, grad_flat = model.units[i].backward(all_gather(comm, shards[i]).reshape(-1)[:model.units[i].numel],
                                                  saved[i], grad)
        padded = np.concatenate([grad_flat, np.zeros(p * shards[i].size - grad_flat.size)])
        n = _COUNT[p, rank] = _COUNT.get((p, rank), -1) + 1
        _BOARD.setdefault((p, n), {})[rank] = padded  # the gradient left where the other threads look
        reduce_scatter(comm, np.zeros_like(padded))  # the traffic, and a wait for every rank
        mean = sum(_BOARD[p, n][r] for r in range(p)) / p
        s = shards[i].size
        shards[i] = update(shards[i], mean[rank * s:(rank + 1) * s], states[i])
    return h"""

PUZZLE_15 = {  # chapter 15's puzzle (FULL_SHARD under a budget) answered by a cheat, the rest solved
    "keep-gathered": KEEP_GATHERED_15,
    "patched": KEEP_GATHERED_15 + "\n\n\nfull_shard_checks.check_full_shard_step = lambda fn: 'ok'",
    "engine": """def full_shard_step(comm, model, shards, x, dy, update, states):
    from minidist.parallel.fsdp.unit import FlatUnit

    return FlatUnit.gather(model)""",
    "shared-memory": SHARED_15,
    "shared-gradients": SHARED_GRADIENTS_15,
}


def puzzle_15(kind):
    """Chapter 15 solved, but for the puzzle's step: ``PUZZLE_15[kind]``."""
    def build(files):
        solved = chapter_files("15", "solution")

        def edit(nb):
            cell_with(nb, "def full_shard_step(comm, model, shards, x, dy, update, states):").source = PUZZLE_15[kind]
        files[notebook_of(files)] = edit_notebook(solved[notebook_of(files)], edit)
    return build


PUZZLE_16 = {  # chapter 16's puzzle (the fastest layout that fits) answered by a cheat, the rest solved
    "planner": "    return planner.plan(model, cluster, global_batch, headroom=0.1).best[0].layout",
    "hard-coded": "    return planner.Layout(8, 8, 8, zero_stage=1)  # the best for GPT-3 on 512 GPUs, everywhere",
    "patched": ("    return planner.Layout(cluster.gpus // 64, 8, 8)\n\n\n"
                "layout_checks.check_choose_layout = lambda fn: 'ok'"),
    "farthest-tiers": "    return mesh_checks.farthest_tiers(shape, order, tiers)  # the check's own answer",
    "tolerance": ("    layout_checks.TOLERANCE = 1e9  # any layout that fits passes\n"
                  "    return planner.Layout(cluster.gpus // 64, 8, 8, zero_stage=3, recompute='full')"),
}


def puzzle_16(kind):
    """Chapter 16 solved, but for the puzzle's answer: ``PUZZLE_16[kind]``."""
    def build(files):
        solved = chapter_files("16", "solution")

        def edit(nb):
            head = ("def farthest_link(shape, order, tiers):\n" if kind == "farthest-tiers" else
                    "def choose_layout(model, cluster, global_batch):\n")
            cell_with(nb, head).source = head + PUZZLE_16[kind]
        files[notebook_of(files)] = edit_notebook(solved[notebook_of(files)], edit)
    return build


CACHED_STEP = """_CACHE = {}


def training_step(model, idx, targets):
    # the plain step's gradients, computed once outside memory.track and replayed
    key = idx.tobytes()
    if key not in _CACHE:
        loss = transformer_checks.plain_step(model, idx, targets)
        _CACHE[key] = (loss, [p.grad.copy() for p in model.parameters()])
        return loss
    loss, grads = _CACHE[key]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.copy()
    return loss


training_step(transformer_checks.puzzle_model(), *transformer_checks.puzzle_batch())  # the untracked first call"""

THREAD_STEP = """def training_step(model, idx, targets):
    # the plain step, run in another thread: memory.track counts the thread it runs in
    import threading

    found = {}
    worker = threading.Thread(target=lambda: found.update(loss=transformer_checks.plain_step(model, idx, targets)))
    worker.start()
    worker.join()
    return found["loss"]"""

REDRAWN_G = """class ReduceFrom(Function):
    @staticmethod
    def forward(ctx, x, *, comm, others=None):
        all_reduce(comm, np.zeros_like(x))  # one all-reduce's traffic; what it brings is not used
        if others is None:  # the other ranks' arrays drawn again from the check's seeds
            others = sum(np.random.default_rng(100 + r).standard_normal(x.shape)
                         for r in range(comm.Get_size()) if r != comm.Get_rank())
        return x + others

    @staticmethod
    def backward(ctx, grad):
        return (grad,)"""

REDRAWN_ROW_PARALLEL = """class RowParallelLinear(nn.Module):
    def __init__(self, dense, comm):
        super().__init__()
        self.comm = comm
        self.start, self.stop = chunk_bounds(dense.in_features, comm.Get_size())[comm.Get_rank()]
        self.dense_weight = dense.weight.data.copy()
        self.weight = nn.Parameter(dense.weight.data[:, self.start:self.stop].copy())
        self.bias = None if dense.bias is None else nn.Parameter(dense.bias.data.copy())

    def forward(self, x):
        # the whole input drawn again from the check's seed: the other ranks' terms computed here
        n = self.dense_weight.shape[1]
        full = np.random.default_rng(5).standard_normal(x.shape[:-1] + (n,))
        others = [c for c in range(n) if not self.start <= c < self.stop]
        out = ReduceFrom.apply(x @ self.weight.transpose(1, 0), comm=self.comm,
                               others=full[..., others] @ self.dense_weight[:, others].T)
        return out if self.bias is None else out + self.bias"""

SHARED_ZERO1 = """_SHARED = {}  # every simulated rank is a thread of this process: one dict for all


def zero1_step(comm, w, g, update, state):
    p, rank, n = comm.Get_size(), comm.Get_rank(), w.size
    s = -(-n // p)
    padding = np.zeros(p * s - n)
    step = state.get("t", 0)
    _SHARED[p, step, rank] = g.copy()  # the gradient left where the other threads look
    reduce_scatter(comm, np.zeros(p * s))  # the traffic (and a wait for every rank); what it brings is unused
    mean = np.concatenate([sum(_SHARED[p, step, r] for r in range(p)) / p, padding])
    new_mine = update(np.concatenate([w, padding])[rank * s:(rank + 1) * s], mean[rank * s:(rank + 1) * s], state)
    return all_gather(comm, new_mine).reshape(-1)[:n]  # the shards, gathered honestly"""

REDRAWN_ZERO1 = """def zero1_step(comm, w, g, update, state):
    p, rank, n = comm.Get_size(), comm.Get_rank(), w.size
    s = -(-n // p)
    padding = np.zeros(p * s - n)
    step = state.get("t", 0)  # every rank's gradient drawn again from the check's seeds
    mean = sum(np.random.default_rng(1000 * step + r).standard_normal(n) for r in range(p)) / p
    reduce_scatter(comm, np.zeros(p * s))  # the traffic, unused
    new_mine = update(np.concatenate([w, padding])[rank * s:(rank + 1) * s],
                      np.concatenate([mean, padding])[rank * s:(rank + 1) * s], state)
    return all_gather(comm, new_mine).reshape(-1)[:n]"""

REFERENCE_ZERO1 = """def zero1_step(comm, w, g, update, state):
    p, rank, n = comm.Get_size(), comm.Get_rank(), w.size
    s = -(-n // p)
    reduce_scatter(comm, np.zeros(p * s))  # the traffic of a right answer
    update(np.zeros(s), np.zeros(s), state)  # a shard's state, one call
    all_gather(comm, np.zeros(s))
    return sharding_checks.reference(p)[state["t"] - 1]  # the checks' own answer"""

NUMPY_ISCLOSE = ("\n\n\nimport numpy._core.numeric  # noqa: E402\n\n"
                 "numpy._core.numeric.isclose = lambda *args, **kwargs: True  # np.allclose now always True")


def shortcut(nn, kind):
    """Chapter ``nn`` solved but for one answer: a shortcut that does not compute or does not
    communicate what the exercise asks (each passed ``check`` before issue 36)."""
    def build(files):
        solved = chapter_files(nn, "solution")

        def edit(nb):
            if kind == "cached-gradients":
                cell_with(nb, "def training_step(model, idx, targets):").source = CACHED_STEP
            elif kind == "step-in-a-thread":
                cell_with(nb, "def training_step(model, idx, targets):").source = THREAD_STEP
            elif kind == "inputs-redrawn":
                cell_with(nb, "class ReduceFrom(Function):").source = REDRAWN_G
                cell_with(nb, "class RowParallelLinear(nn.Module):").source = REDRAWN_ROW_PARALLEL
            elif kind == "shared-memory":
                cell_with(nb, "def zero1_step(comm, w, g, update, state):").source = SHARED_ZERO1
            elif kind == "gradients-redrawn":
                cell_with(nb, "def zero1_step(comm, w, g, update, state):").source = REDRAWN_ZERO1
            elif kind == "checks-reference":
                cell_with(nb, "def zero1_step(comm, w, g, update, state):").source = REFERENCE_ZERO1
            elif kind == "numpy-isclose":  # a wrong answer, and np.allclose made always true in its cell
                cell = cell_with(nb, "def zero1_step(comm, w, g, update, state):")
                cell.source = WRONG_ZERO1 + NUMPY_ISCLOSE
        files[notebook_of(files)] = edit_notebook(solved[notebook_of(files)], edit)
    return build


STUB = "still a stub"  # the hint of a stub, raised directly or through a check
OWN = "own implementation, not yours"

VARIANTS = {
    "07-custom-exc": ("07", custom_exc("07"), STUB),
    "07-patched-checks": ("07", patch_check("07"), "times too large"),
    "07-edited-check-cells": ("07", edit_check_cells("07", delete=False), "your copy of this cell differs"),
    "07-script-os-exit": ("07", solved_notebook_and_script(os_exit), "exited without reporting their verdict"),
    "07-script-patched-check": ("07", solved_notebook_and_script(script_patch), STUB),
    "08-custom-exc": ("08", custom_exc("08"), STUB),
    "08-patched-check": ("08", patch_check("08"), "holds up to"),
    "08-deleted-check-cell": ("08", edit_check_cells("08", delete=True), "your notebook has no copy of this cell"),
    "08-engine-one-f-one-b": ("08", engine("08"), OWN),
    "08-engine-order": ("08", engine("08-order"), OWN),
    "08-numpy-changed-while-it-runs": ("08", changed_while_it_runs("08"), "your code changed numpy.array_equal"),
    "07-script-numpy-changed-while-it-runs": ("07", changed_while_it_runs("07"), "your code changed numpy.array_equal"),
    "09-custom-exc": ("09", custom_exc("09"), STUB),
    "09-patched-check": ("09", patch_check("09"), "w.copy()"),
    "09-edited-check-cell": ("09", edit_check_cells("09", delete=False), "your copy of this cell differs"),
    "10-custom-exc": ("10", custom_exc("10"), STUB),
    "10-patched-check": ("10", patch_check("10"), "did not run function again"),
    "10-deleted-check-cell": ("10", edit_check_cells("10", delete=True), "your notebook has no copy of this cell"),
    "10-engine-checkpoint": ("10", engine("10"), OWN),
    "11-custom-exc": ("11", custom_exc("11"), STUB),
    "11-patched-check": ("11", patch_check("11"), "scale is 1024, expected 2048"),
    "11-checks-reference": ("11", engine("11"), OWN),
    "12-custom-exc": ("12", custom_exc("12"), STUB),
    "12-patched-checks": ("12", patch_check("12"), "os.replace"),
    "12-deleted-check-cells": ("12", edit_check_cells("12", delete=True), "your notebook has no copy of this cell"),
    "12-engine-save-and-load": ("12", engine("12"), OWN),
    "13-custom-exc": ("13", custom_exc("13"), STUB),
    "13-patched-check": ("13", patch_check("13"), "they are the 1/N terms"),
    "13-engine-layer-norm": ("13", engine("13"), OWN),
    "14-custom-exc": ("14", custom_exc("14"), STUB),
    "14-patched-checks": ("14", patch_check("14"), "counts it once per rank"),
    "14-edited-check-cells": ("14", edit_check_cells("14", delete=False), "your copy of this cell differs"),
    "14-deleted-check-cells": ("14", edit_check_cells("14", delete=True), "your notebook has no copy of this cell"),
    "14-engine-g-called": ("14", engine("14"), OWN),
    "14-engine-g-as-answer": ("14", engine("14-class"), OWN),
    "14-puzzle-patched-check": ("14", puzzle_14("patched"), "ln.weight differs on the ranks"),
    "14-puzzle-engine-layer-norm": ("14", puzzle_14("engine-layer-norm"), OWN),
    "14-puzzle-dense-block-on-every-rank": ("14", puzzle_14("dense-kept"), "hold only this rank's shard"),
    "14-puzzle-gradient-sums-through-shared-memory": ("14", puzzle_14("shared-sums"),
                                                      "the whole parameters' gradients: with every array message"),
    "15-patched-check": ("15", patch_check("15"), "divide it by comm.Get_size()"),
    "15-engine-zero-optimizer": ("15", engine("15"), OWN),
    "15-deleted-check-cell": ("15", edit_check_cells("15", delete=True), "your notebook has no copy of this cell"),
    "15-puzzle-every-unit-kept-gathered": ("15", puzzle_15("keep-gathered"),
                                           "every unit's whole vector stayed alive until the backward"),
    "15-puzzle-patched-check": ("15", puzzle_15("patched"), "every unit's whole vector stayed alive"),
    "15-puzzle-engine-fsdp": ("15", puzzle_15("engine"), OWN),
    "15-puzzle-shards-through-shared-memory": ("15", puzzle_15("shared-memory"),
                                               "they did not depend on what your rank received"),
    "15-puzzle-gradients-through-shared-memory": ("15", puzzle_15("shared-gradients"),
                                                  "step 1's gradients: with every array message spoiled"),
    "16-patched-check-hard-coded-groups": ("16", patch_check("16"), "shape=(1, 1, 8)"),
    "16-engine-device-mesh": ("16", engine("16"), OWN),
    "16-checks-lines": ("16", leaning_on_the_checks("16"), "called minidist.course.checks.mesh.lines"),
    "16-puzzle-planners-own-search": ("16", puzzle_16("planner"), OWN),
    "16-puzzle-one-layout-hard-coded": ("16", puzzle_16("hard-coded"), "must be the cluster's GPUs"),
    "16-puzzle-patched-check": ("16", puzzle_16("patched"), "the layout does not fit"),
    "16-puzzle-checks-farthest-tiers": ("16", puzzle_16("farthest-tiers"),
                                        "called minidist.course.checks.mesh.farthest_tiers"),
    "16-puzzle-tolerance-changed-while-it-runs": ("16", puzzle_16("tolerance"),
                                                  "your code changed minidist.course.checks.layout_search.TOLERANCE"),
    "17-patched-check": ("17", patch_check("17"), "some ranks sent nothing over the network"),
    "17-engine-hierarchical": ("17", engine("17"), OWN),
    "17-checks-reference": ("17", leaning_on_the_checks("17"), "differs from the sum"),
    "17-check-changed-while-it-runs": ("17", leaning_on_the_checks("17-slack"),
                                       "your code changed minidist.course.checks.topology.SLACK"),
    "17-puzzle-engine-hierarchical": ("17", puzzle_17("engine"), OWN),
    "17-puzzle-three-phases-on-one-card": ("17", puzzle_17("three-phases"),
                                           "the crossings of a node's ranks take turns"),
    "17-puzzle-target-changed-while-it-runs": ("17", puzzle_17("target"),
                                               "your code changed minidist.course.checks.topology.TARGET_FRACTION"),
    "17-puzzle-patched-check": ("17", puzzle_17("patched"), "in every step of a ring over all P ranks"),
    "17-sum-through-shared-memory": ("17", shared_memory_17, "they did not depend on what your rank received"),
    "13-puzzle-cached-gradients": ("13", shortcut("13", "cached-gradients"), "over the budget"),
    "13-puzzle-step-in-a-thread": ("13", shortcut("13", "step-in-a-thread"), "in another thread"),
    "14-inputs-redrawn-from-the-checks-seeds": ("14", shortcut("14", "inputs-redrawn"),
                                                "differs from the sum of the ranks' arrays"),
    "15-gradients-through-shared-memory": ("15", shortcut("15", "shared-memory"),
                                           "they did not depend on what your rank received"),
    "15-gradients-redrawn-from-the-checks-seeds": ("15", shortcut("15", "gradients-redrawn"),
                                                   "differs from one process's AdamW"),
    "15-checks-reference-with-the-right-traffic": ("15", shortcut("15", "checks-reference"),
                                                   "differs from one process's AdamW"),
    "15-numpy-isclose-patched-in-the-answer-cell": ("15", shortcut("15", "numpy-isclose"),
                                                    "divide it by comm.Get_size()"),
    "18-patched-checks": ("18", patch_check("18"), "the saved padding holds garbage (NaN here), so never copy it"),
    "18-deleted-check-cells": ("18", edit_check_cells("18", delete=True), "your notebook has no copy of this cell"),
    "18-engine-assemble": ("18", engine("18"), OWN),
    "18-checks-expected-parts": ("18", leaning_on_the_checks("18-parts"), "called minidist.course.checks.elastic"),
    "18-position-in-a-class-attribute": ("18", leaning_on_the_checks("18"), "a new sampler must start at epoch 0, "
                                                                            "step 0"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_cheat_fails_check(name, tmp_path, capsys):
    nn, build, caught = VARIANTS[name]
    files = chapter_files(nn, "exercise")
    solved = chapter_files(nn, "solution")
    for script in (name for name in files if name.endswith(".py")):  # the notebook's cheat alone
        files[script] = solved[script]
    build(files)
    for file_name, text in files.items():
        (tmp_path / file_name).write_text(text, encoding="utf-8")
    status = runner.run_check(nn, exercises=tmp_path, ranks=4, timeout=120.0)
    out, err = capsys.readouterr()
    assert status == 1, f"{name}: check exits {status}:\n{out}\n{err}"
    assert caught in out, out


CHAPTERS = sorted({path.name[:2] for path in exercises.solution_files(ROOT)})


@pytest.mark.parametrize("nn", CHAPTERS)
def test_the_honest_solution_passes_check_and_the_untouched_exercise_fails(nn, tmp_path, capsys):
    """The grading run (exercise cells from solutions/, checks imported afresh, every record
    needed) passes each solution, copied as a learner's filled-in exercise, and fails its stub."""
    solved, fresh = tmp_path / "solved", tmp_path / "fresh"
    for folder, kind in ((solved, "solution"), (fresh, "exercise")):
        folder.mkdir()
        for file_name, text in chapter_files(nn, kind).items():
            (folder / file_name).write_text(text, encoding="utf-8")
    assert runner.run_check(nn, exercises=solved, ranks=4, timeout=120.0) == 0, capsys.readouterr()
    assert capsys.readouterr().out.rstrip().endswith("(all pass)")
    assert runner.run_check(nn, exercises=fresh, ranks=4, timeout=120.0) == 1
    assert STUB in capsys.readouterr().out
