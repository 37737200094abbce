"""A time limit on Python work in the calling thread (chat-template rendering), without a process.

A Jinja template is compiled to Python; a template that loops (``{% for i in range(10**5) %}{% for j
in range(10**5) %}``) would hold the front-end thread, and with it every request's tokenization.
``call_with_deadline`` runs ``fn`` in the calling thread and, past the limit, raises an exception
inside it from a timer (``PyThreadState_SetAsyncExc``: delivered at the next bytecode, so pure-Python
loops stop; a long C call stops when it returns). The exception is a BaseException subclass so no
``except Exception`` in the template engine swallows it; the caller gets ``DeadlineExceeded``.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


class _Interrupt(BaseException):
    """Raised inside the thread whose deadline passed."""


class DeadlineExceeded(Exception):
    """``fn`` ran past its limit and was stopped."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


def call_with_deadline(fn: Callable[[], T], seconds: float) -> T:
    """``fn()``, or DeadlineExceeded once it has run ``seconds``. Exceptions of ``fn`` propagate."""
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"running": True, "fired": False}

    def fire() -> None:
        with lock:
            if state["running"]:
                state["fired"] = True
                _raise_in(thread_id, _Interrupt)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    try:
        try:
            timer.start()
            return fn()
        finally:
            with lock:
                state["running"] = False
            timer.cancel()
            if state["fired"]:
                _raise_in(thread_id, None)  # not yet delivered: withdraw it
    except _Interrupt:
        raise DeadlineExceeded(f"stopped after {seconds:g} s") from None
