"""Stop strings matched over a growing text by an Aho–Corasick automaton (Aho & Corasick, 1975):
memory O(total stop length), amortised O(1) per character. Its state is the longest suffix of the
text that is a prefix of a stop string (the text held back)."""

from __future__ import annotations

_CHAR_BITS = 21  # every code point is below 2**21


class StopMatcher:
    """Feed text with :meth:`feed`; ``stops`` is a non-empty list of non-empty strings."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._goto: dict[int, int] = {}  # (node << _CHAR_BITS) | code point -> child node
        self._depth = [0]
        self._fail = [0]
        self._match = [-1]  # index into stops of the longest stop string ending at the node, or -1
        self._has_child = bytearray(1)
        self._state = 0
        self._build()

    def _build(self) -> None:
        # breadth first: every fail link points to a node already finished
        nodes = [0] * len(self.stops)
        for depth in range(max(len(s) for s in self.stops)):
            created = []
            for i, stop in enumerate(self.stops):
                if depth < len(stop):
                    nodes[i] = self._child(nodes[i], stop[depth], created)
                    if depth + 1 == len(stop) and self._match[nodes[i]] < 0:
                        self._match[nodes[i]] = i
            for node in created:
                if self._match[node] < 0:
                    self._match[node] = self._match[self._fail[node]]

    def _child(self, parent: int, char: str, created: list[int]) -> int:
        key = (parent << _CHAR_BITS) | ord(char)
        node = self._goto.get(key)
        if node is None:
            node = self._goto[key] = len(self._depth)
            self._depth.append(self._depth[parent] + 1)
            self._fail.append(0 if parent == 0 else self._step(self._fail[parent], char))
            self._match.append(-1)
            self._has_child.append(0)
            self._has_child[parent] = 1
            created.append(node)
        return node

    def _step(self, state: int, char: str) -> int:
        code = ord(char)
        while True:
            node = self._goto.get((state << _CHAR_BITS) | code)
            if node is not None:
                return node
            if state == 0:
                return 0
            state = self._fail[state]

    def feed(self, text: str, report: bool = True) -> tuple[int, str] | None:
        """Advance over ``text``; with ``report``, stop at the first stop string ending in it (the
        longest there) and return ``(end, stop)``, ``end`` in characters of ``text``."""
        state, match = self._state, self._match
        for i, char in enumerate(text):
            state = self._step(state, char)
            if report and match[state] >= 0:
                self._state = state
                return i + 1, self.stops[match[state]]
        self._state = state
        return None

    def num_held(self) -> int:
        """Length of the longest suffix of the text fed so far that is a proper prefix of a stop string."""
        state = self._state
        while state and not self._has_child[state]:
            state = self._fail[state]
        return self._depth[state]
