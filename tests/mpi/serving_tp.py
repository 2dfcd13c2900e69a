"""Serving under real mpiexec -n 2 against one process (run by tests/test_serving.py): tensor-parallel
decode over the two ranks (each rank's KV cache holds one head of two), the continuous-batching
scheduler on every rank drawing the same tokens, each request's tokens equal to GPT.generate of it
alone in one process (float64); then the two ranks as data-parallel replicas behind rank 0's front,
every request served as one process serves it. Prints 'SERVING TP OK' on rank 0, or the problems."""
import numpy as np
from mpi4py import MPI

from minidist.collectives import gather_objects
from minidist.models.gpt import GPT, GPTConfig
from minidist.serving import ReplicaFront, Request, Scheduler, TensorParallelDecoder, serve_replica

comm = MPI.COMM_WORLD
config = GPTConfig(vocab_size=13, block_size=24, n_layer=2, n_head=2, n_embd=8)
model = GPT(config, rng=0, dtype="float64")
rng = np.random.default_rng(7)
requests = [Request(rng.integers(0, 13, size=int(rng.integers(1, 8))).tolist(), int(rng.integers(1, 12)),
                    temperature=0.8, top_k=[None, 4][i % 2], seed=i) for i in range(6)]


def serve(scheduler, arrivals):
    """Step until idle, adding arrivals[step] before each step; {id: tokens}, {id: request}."""
    tokens, sent, step = {}, {}, 0
    while step in arrivals or scheduler.has_work():
        for request in arrivals.get(step, []):
            sent[scheduler.add(request)] = request
        for event in scheduler.step():
            if event.token_id is not None:
                tokens.setdefault(event.request_id, []).append(event.token_id)
        step += 1
    return tokens, sent


def alone(request):
    out = model.generate(np.array([request.prompt_ids]), request.max_tokens, temperature=request.temperature,
                         top_k=request.top_k, rng=request.seed, use_cache=False)
    return out[0, len(request.prompt_ids):].tolist()


problems = []
decoder = TensorParallelDecoder(model, comm)
scheduler = Scheduler(decoder, kv_block_size=4, max_batch=3)
tokens, sent = serve(scheduler, {0: requests[:4], 3: requests[4:]})
everyone = gather_objects(comm, (tokens, scheduler.kv_cache.nbytes))
if comm.Get_rank() == 0:
    dense = Scheduler(model, kv_block_size=4, max_batch=3)
    serve(dense, {0: requests[:1]})
    if everyone[0][0] != everyone[1][0]:
        problems.append("the two ranks drew different tokens")
    for request_id, request in sent.items():
        if tokens[request_id] != alone(request):
            problems.append(f"tp request {request_id}: {tokens[request_id]} != {alone(request)}")
    if [2 * b for _, b in everyone] != [dense.kv_cache.nbytes] * 2:
        problems.append(f"KV bytes per rank {[b for _, b in everyone]}, the dense pool {dense.kv_cache.nbytes}")

replica = Scheduler(model, kv_block_size=4, max_batch=2)
if comm.Get_rank() == 0:
    front = ReplicaFront(comm, replica)
    tokens, sent = serve(front, {0: requests[:4], 2: requests[4:]})
    front.close()
    for request_id, request in sent.items():
        if tokens[request_id] != alone(request):
            problems.append(f"replicated request {request_id}: {tokens[request_id]} != {alone(request)}")
    if min(front.served) < 1:
        problems.append(f"a replica served nothing: {front.served}")
    print("SERVING TP OK" if not problems else "\n".join(problems), flush=True)
else:
    serve_replica(comm, replica)
