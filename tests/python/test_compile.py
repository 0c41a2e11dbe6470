"""prefire.compile: blocks compiled with inductor whose recomputation under
prefire's checkpoint runs only what their compiled backward reads (Note [A
compiled block's recomputation program] in prefire/_compile.py). Every test
compiles with inductor (CPU). A test fails when torch changes what
prefire.compile reads: the program stops running (program_runs) or the
gradients change."""

import contextlib
import warnings

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as torch_wrapper

import prefire
from prefire import _compile, _warn_once
from test_checkpoint import Block


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles Block.forward anew: the tests between them compile it
    under more backends and guards than dynamo's recompile limit keeps."""
    torch._dynamo.reset()


def blocks_and_input(n=2, dropout=0.0):
    torch.manual_seed(0)
    blocks = [Block(dim=32, heads=4, dropout=dropout) for _ in range(n)]
    x = torch.randn(2, 8, 32, requires_grad=True)
    return blocks, x


def gradients(blocks, layers, x, seed=3, collected=True):
    """The gradients of a step; its forward inside prefire.collect() where
    ``collected`` (prefire's path for a prefire.compile'd block, Note [A
    block no collector sees runs torch's compiled checkpoint])."""
    torch.manual_seed(seed)
    h = x
    with prefire.collect() if collected else contextlib.nullcontext():
        for layer in layers:
            h = layer(h)
    params = [p for b in blocks for p in b.parameters()]
    return torch.autograd.grad(h.square().mean(), [x, *params], allow_unused=True, materialize_grads=True)


def assert_equal(got, expected):
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_a_checkpointed_prefire_compiled_block_recomputes_with_its_program_and_gives_compiles_gradients():
    blocks, x = blocks_and_input()
    expected = gradients(blocks, [torch.compile(b) for b in blocks], x)
    layers = [prefire.checkpoint_wrapper(prefire.compile(b)) for b in blocks]
    for _ in range(2):
        runs, recomputations = _compile.program_runs, prefire.runtime_stats().recomputations
        got = gradients(blocks, layers, x)
        assert _compile.program_runs - runs == len(blocks)  # each recomputation ran the block's program
        assert prefire.runtime_stats().recomputations - recomputations == len(blocks)
        # forward and backward are torch.compile's; the program computes the
        # saved tensors as the compiled forward does
        assert_equal(got, expected)


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_a_prefire_compiled_block_no_collector_sees_is_torchs_compiled_checkpoint(dropout):
    blocks, x = blocks_and_input(dropout=dropout)
    expected = gradients(blocks, [torch.compile(torch_wrapper(b)) for b in blocks], x)
    layers = [prefire.checkpoint_wrapper(prefire.compile(b)) for b in blocks]
    for _ in range(2):
        runs, recomputations = _compile.program_runs, prefire.runtime_stats().recomputations
        assert_equal(gradients(blocks, layers, x, collected=False), expected)
        # the compiled backward recomputed, as torch's compiled checkpoint's does
        assert prefire.runtime_stats().recomputations == recomputations
        assert _compile.program_runs == runs
    assert saved_bytes(layers[0], x) == saved_bytes(torch.compile(torch_wrapper(blocks[0])), x)
    # collected, the same blocks take prefire's path: a handle each, recomputed by prefire
    recomputations = prefire.runtime_stats().recomputations
    with prefire.collect() as handles:
        h = x
        for layer in layers:
            h = layer(h)
    assert len(handles) == len(blocks)
    h.sum().backward()
    assert prefire.runtime_stats().recomputations - recomputations == len(blocks)
    with pytest.raises(ValueError, match="determinism_check must be"):
        prefire.checkpoint(prefire.compile(blocks[0]), x, determinism_check="bits")


@torch._functorch.config.patch(donated_buffer=False)  # B keeps the graph for W (retain_graph)
def test_session_scopes_around_the_passes_of_a_block_no_collector_saw_warn_that_nothing_was_shared():
    # Note [A block no collector sees runs torch's compiled checkpoint]: the runtime sees no recomputation there
    blocks, x = blocks_and_input(n=1)
    layer = prefire.checkpoint_wrapper(prefire.compile(blocks[0]))
    for collected in (False, True):
        _warn_once.warned.discard("session-torch-path")
        with prefire.collect() if collected else contextlib.nullcontext() as handles:
            loss = layer(x).square().mean()
        if collected:
            prefire.attach(handles[0], 7)
        backwards = _compile.torch_path_backwards
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with prefire.session(7, retain_on_unpack=True):  # B
                torch.autograd.grad(loss, x, retain_graph=True)
            with prefire.session(7):  # W
                torch.autograd.grad(loss, list(blocks[0].parameters()))
        prefire.clear_session(7)
        said = [str(w.message) for w in said if "no session shares" in str(w.message)]
        assert _compile.torch_path_backwards - backwards == (0 if collected else 2)
        assert len(said) == (0 if collected else 1), said
        assert collected or said[0].startswith("prefire: session 7's scope ran the backward of prefire.compile'd")


def test_a_prefire_compiled_block_inside_another_checkpoint_takes_prefires_path_in_forward_and_recomputation():
    # its forward (outer forward) and its recomputation (outer recomputation, no collector open) run one program
    blocks, x = blocks_and_input(n=1)
    expected = gradients(blocks, [torch.compile(blocks[0])], x)
    compiled = prefire.compile(blocks[0])
    runs, recomputations = _compile.program_runs, prefire.runtime_stats().recomputations
    got = gradients(blocks, [lambda h: prefire.checkpoint(lambda z: prefire.checkpoint(compiled, z) * 1, h)], x,
                    collected=False)
    assert_equal(got, expected)
    assert prefire.runtime_stats().recomputations - recomputations == 2  # the outer checkpoint, then the inner
    assert _compile.program_runs - runs == 1


def test_outside_a_checkpoint_and_with_early_stop_off_a_prefire_compiled_block_is_torch_compiles():
    blocks, x = blocks_and_input(n=1)
    expected = gradients(blocks, [torch.compile(b) for b in blocks], x)
    runs = _compile.program_runs
    assert_equal(gradients(blocks, [prefire.compile(b) for b in blocks], x), expected)
    assert _compile.program_runs == runs
    compiled = prefire.compile(blocks[0])
    got = gradients(blocks, [lambda h: prefire.checkpoint(compiled, h, early_stop=False)], x)
    assert _compile.program_runs - runs == 1  # the empty returns it handed AOTAutograd were dropped
    assert_equal(got, expected)


def test_a_checkpoint_whose_function_reads_the_compiled_blocks_output_recomputes_all_of_it():
    # the program hands AOTAutograd empty returns: only where nothing reads them
    blocks, x = blocks_and_input(n=1)
    compiled = prefire.compile(blocks[0])
    expected = gradients(blocks, [lambda h: torch.compile(blocks[0])(h).tanh()], x)
    runs = _compile.program_runs
    _warn_once.warned.clear()
    with pytest.warns(UserWarning, match="returned other than its compiled graph's outputs"):
        got = gradients(blocks, [lambda h: prefire.checkpoint(lambda z: compiled(z).tanh(), h)], x)
    assert _compile.program_runs == runs
    assert_equal(got, expected)

    # an in-place op on the compiled output saves it (mul_ saves its input for w's gradient)
    w = torch.randn(32, requires_grad=True)
    expected = torch.autograd.grad(torch.compile(blocks[0])(x).mul_(w).square().mean(), [x, w])
    got = torch.autograd.grad(prefire.checkpoint(lambda z: compiled(z).mul_(w), x).square().mean(), [x, w])
    assert _compile.program_runs == runs
    assert_equal(got, expected)

    def broken(z):  # two graphs: the second reads the first's outputs
        z = blocks[0].ln1(z) * 2
        torch._dynamo.graph_break()
        return z.sigmoid() @ blocks[0].fc1.weight.t()

    with pytest.warns(UserWarning, match="ran more than one compiled graph"):
        got = gradients(blocks, [lambda h: prefire.checkpoint(prefire.compile(broken), h)], x)
    assert _compile.program_runs == runs
    assert_equal(got, gradients(blocks, [torch.compile(broken)], x))


def test_a_block_that_draws_random_numbers_recomputes_all_of_its_compiled_forward():
    blocks, x = blocks_and_input(n=1, dropout=0.5)
    expected = gradients(blocks, [torch.compile(blocks[0])], x)
    runs = _compile.program_runs
    # a program would draw its dropout masks differently: forward's masks come back from the whole forward
    _warn_once.warned.clear()
    with pytest.warns(UserWarning, match="draws random numbers"):
        got = gradients(blocks, [prefire.checkpoint_wrapper(prefire.compile(blocks[0]))], x)
    assert_equal(got, expected)
    assert _compile.program_runs == runs


def test_a_block_that_updates_buffers_updates_them_in_its_program_as_in_the_whole_forward():
    # inductor updates the running statistics inside the graph; dead-code
    # elimination keeps what mutates, so the recomputation updates them as the
    # whole compiled forward (and torch's checkpoint) does
    def norm():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(8), torch.nn.Linear(32, 32))

    _, x = blocks_and_input(n=1)
    program, whole = norm(), norm()
    runs = _compile.program_runs
    got = gradients([program], [prefire.checkpoint_wrapper(prefire.compile(program))], x)
    assert _compile.program_runs - runs == 1
    assert_equal(got, gradients([whole], [prefire.checkpoint_wrapper(torch.compile(whole))], x))
    assert_equal(list(program.buffers()), list(whole.buffers()))
    assert program[1].num_batches_tracked == 2


def saved_bytes(layer, x):
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(storages.values())


def test_an_activation_memory_budget_makes_the_compiled_forward_and_its_program_save_less():
    blocks, x = blocks_and_input(n=1)
    with torch._functorch.config.patch(activation_memory_budget=0.1):
        expected = gradients(blocks, [torch.compile(blocks[0])], x)
    layer = prefire.checkpoint_wrapper(prefire.compile(blocks[0], activation_memory_budget=0.1))
    runs = _compile.program_runs
    assert_equal(gradients(blocks, [layer], x), expected)
    assert _compile.program_runs - runs == 1
    assert saved_bytes(prefire.compile(blocks[0], activation_memory_budget=0.1), x) < saved_bytes(
        prefire.compile(blocks[0]), x)
    with pytest.raises(ValueError, match="activation_memory_budget must be in"):
        prefire.compile(blocks[0], activation_memory_budget=2)


def test_a_program_whose_tensors_differ_from_the_compiled_forwards_raises():
    blocks, x = blocks_and_input(n=1)
    layer = prefire.checkpoint_wrapper(prefire.compile(blocks[0]))
    gradients(blocks, [layer], x)
    chosen = []
    original = _compile._Forward._recompute

    def altered(self, args, forward):
        chosen.append(forward)
        size, stride, dtype, device = forward.layouts[-1]
        forward.layouts[-1] = (size, stride, torch.float64, device)
        return original(self, args, forward)

    _compile._Forward._recompute = altered
    try:
        with pytest.raises(prefire.CheckpointError, match="recomputation program's saved tensor"):
            gradients(blocks, [layer], x)
    finally:
        _compile._Forward._recompute = original
        size, stride, _, device = chosen[0].layouts[-1]
        chosen[0].layouts[-1] = (size, stride, torch.float32, device)


def test_prefire_compile_refuses_cuda_graphs():
    with pytest.raises(ValueError, match="CUDA graphs"):
        prefire.compile(torch.nn.Linear(2, 2), mode="reduce-overhead")
