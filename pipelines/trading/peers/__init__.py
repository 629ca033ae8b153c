"""The trading family's local peers over real HTTP on loopback: the broker
(:mod:`pipelines.trading.peers.broker`), the AI coach (:mod:`.coach`) and market data
(:mod:`.market`). :class:`TradingPeers` starts the three; :func:`serve` is
``conveyor trading peers``.

Nothing heavy is imported here (the CLI imports this module): the peers' modules load when
they start.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Self, TypeVar

if TYPE_CHECKING:
    from pipelines.trading.peers.broker import BrokerPeer
    from pipelines.trading.peers.coach import CoachPeer
    from pipelines.trading.peers.market import MarketPeer

__all__ = ["TradingPeers", "serve"]

_Peer = TypeVar("_Peer")


class TradingPeers:
    """The broker, AI coach and market-data peers on ``host`` (each port 0: a free one), the
    coach checking signatures by ``ai_key_id``/``ai_secret``. ``.broker``, ``.coach`` and
    ``.market`` are the peer objects once started. Usable as a context manager."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        broker_port: int = 0,
        market_port: int = 0,
        ai_port: int = 0,
        ai_key_id: str = "dev",
        ai_secret: str = "dev-secret",
    ) -> None:
        self.host = host
        self._ports = (broker_port, market_port, ai_port)
        self._ai_key_id = ai_key_id
        self._ai_secret = ai_secret
        self._broker: BrokerPeer | None = None
        self._coach: CoachPeer | None = None
        self._market: MarketPeer | None = None

    @property
    def broker(self) -> BrokerPeer:
        """The broker peer (after :meth:`start`)."""
        return _started(self._broker, "broker")

    @property
    def coach(self) -> CoachPeer:
        """The AI coach peer (after :meth:`start`)."""
        return _started(self._coach, "coach")

    @property
    def market(self) -> MarketPeer:
        """The market-data peer (after :meth:`start`)."""
        return _started(self._market, "market")

    def start(self) -> Self:
        """Start the three peers (stopping those already started if one fails); returns self."""
        from pipelines.trading.peers.broker import BrokerPeer
        from pipelines.trading.peers.coach import CoachPeer
        from pipelines.trading.peers.market import MarketPeer

        broker_port, market_port, ai_port = self._ports
        try:
            self._broker = BrokerPeer(host=self.host, port=broker_port).start()
            self._market = MarketPeer(host=self.host, port=market_port).start()
            self._coach = CoachPeer(
                host=self.host, port=ai_port, key_id=self._ai_key_id, secret=self._ai_secret
            ).start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the peers that run (idempotent)."""
        for peer in (self._coach, self._market, self._broker):
            if peer is not None:
                peer.stop()
        self._broker = self._coach = self._market = None

    def urls(self) -> dict[str, str]:
        """The base URLs by role: ``broker``, ``market``, ``ai``."""
        return {"broker": self.broker.url, "market": self.market.url, "ai": self.coach.url}

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _started(peer: _Peer | None, name: str) -> _Peer:
    if peer is None:
        raise RuntimeError(f"the {name} peer is not running: call TradingPeers.start() first")
    return peer


def serve(broker_port: int, market_port: int, ai_port: int, ai_key_id: str, ai_secret: str) -> None:
    """Run the three peers in the foreground: print ``broker=URL``, ``market=URL`` and
    ``ai=URL`` lines, then block until SIGTERM or SIGINT, stop them and return. Call it from
    the main thread (it installs signal handlers, restored on return)."""
    stopping = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        peers = TradingPeers(
            broker_port=broker_port,
            market_port=market_port,
            ai_port=ai_port,
            ai_key_id=ai_key_id,
            ai_secret=ai_secret,
        )
        with peers:
            for role, url in peers.urls().items():
                print(f"{role}={url}", flush=True)
            while not stopping.wait(0.5):
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
