"""`owner_thread_only`: a hook one model call registers acts on that call's thread alone (the
colocated server runs steps of different stages at once on one model)."""

from __future__ import annotations

import threading

import torch

from epd.model_runtime.thread_hooks import owner_thread_only


def _in_thread(fn):
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join(30)
    return out[0]


def test_a_hook_changes_the_owner_threads_forward_and_no_other():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with torch.no_grad():
        plain = layer(x)
        handle = layer.register_forward_hook(owner_thread_only(lambda _m, _args, out: out * 0))
        try:
            assert torch.equal(layer(x), torch.zeros_like(plain))  # the owner's forward: hooked
            assert torch.equal(_in_thread(lambda: layer(x)), plain)  # another thread's: untouched
        finally:
            handle.remove()


def test_a_wrapped_hook_keeps_its_return_value_and_name_in_the_owner_thread():
    def named(*args):
        return "seen"

    hook = owner_thread_only(named)
    assert hook() == "seen" and hook.__name__ == "named"
    assert _in_thread(hook) is None
