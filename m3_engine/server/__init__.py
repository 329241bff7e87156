"""``m3-serve``: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

    m3-serve MODEL_DIR --framework torch --port 8000 --max-num-seqs 32 --max-model-len 8192
    python -m m3_engine.server MODEL_DIR --framework jax --api-key secret --served-model-name m3

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")
    client.completions.create(model="m3", prompt="Hello", max_tokens=16)
    client.chat.completions.create(model="m3", messages=[{"role": "user", "content": "Hi"}], stream=True)

One module per concern:

* ``protocol``:      OpenAI's request bodies (pydantic) and error body (``APIError``).
* ``app``:           ``create_app``: the routes, streaming (server-sent events); every
                     endpoint, field and rule is in its docstring.
* ``engine_client``: ``EngineClient``, what the routes talk to: the front end of the engine
                     (add, abort, detokenization and stop strings, each request's outputs,
                     health, load).
* ``core_process``:  the engine core in a process of its own: its start, its ZMQ sockets
                     and msgspec messages, its loop.
* ``metrics``:       ``/metrics`` (Prometheus text, our names and vLLM's).
* ``cli``:           the command line (``main``): flags, model load, uvicorn, shutdown.

Needs the ``server`` extra (``pip install 'm3-msa-kernels[server]'``); importing this
package alone imports none of it.
"""
