"""The `native` rollout engine: plain-torch generation over a transformers Qwen2/Qwen3/Llama/
Mistral model's own modules, with continuous batching, a slot KV cache and CUDA-graph decode.

    role.NativeRollout      the rollout backend (ops: generate [async], load_weights,
      |                     sleep, wake_up; update_weights for a colocated actor)
      +-- ../weights.InPlaceWeights   in-place / aliased weight updates (shared with hf)
      +-- frontend.AsyncEngine     one thread owns the device; asyncio futures per request
            +-- engine.NativeEngine    add_request / step(): prefill, decode, retire
                  +-- scheduler.Scheduler   pure slot bookkeeping (rows dense in slots)
                  +-- kv_cache.SlotCache    KV cache + per-slot decode buffers
                  +-- forward.model.NativeModel   prefill/decode over the HF modules
                  |     +-- forward.fused.FusedDecode   decode in few kernels
                  +-- sampler               per-row counter-based sampling, log-probs
                  +-- graphs.DecodeGraphs   CUDA graphs per batch-size bucket

`request` holds the engine's input/output types. Nothing here imports the transport
layer (no pyzmq/msgspec needed).
"""
