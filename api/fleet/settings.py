"""The fleet service's one settings object (flags > environment ``FRACTAL_FLEET_*`` > defaults)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from federation.bounds import Steps, StepTimeout
from federation.topics import validate_id

__all__ = ["FleetSettings"]


class FleetSettings(BaseSettings):
    """Everything the fleet service needs; ``FRACTAL_FLEET_TOKEN`` sets :attr:`token`."""

    model_config = SettingsConfigDict(env_prefix="FRACTAL_FLEET_", extra="ignore")

    broker: str = "mqtt://127.0.0.1:1883"
    swarm: str = "default"
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    # Operator token: every route but health needs it (Bearer header, login cookie or ?token=).
    token: str = Field(default="", repr=False)
    tls_ca: str | None = None  # CA file for mqtts:// brokers with a private CA
    client_id: str = ""  # MQTT client id; empty = "fleet-<random>"
    # Signed swarm (deploy/keys.py): the fleet's key file and the swarm keyring. With both set,
    # every command is signed and statuses/events without a valid member signature are dropped.
    key_file: str | None = None
    keyring_file: str | None = None
    # A round fails when a participant sends nothing for this long (first event, then between events).
    round_start_timeout_s: float = Field(default=45.0, gt=0)
    round_idle_timeout_s: float = Field(default=60.0, gt=0)
    # A participant's offline status (a Last Will fires on a dropped connection too) fails its
    # round only if the node has not reported again this long after; 0: at once.
    round_offline_grace_s: float = Field(default=5.0, ge=0, le=600)
    # Forwarded to nodes in RoundCommand: the command's bounds (federation/roundspec.py), so a
    # setting the command cannot carry fails at start, not as a 500 on every round.
    step_timeout_s: StepTimeout = 30.0
    max_steps: Steps = 10_000
    # A round whose swarm validation got worse by more than this is rolled back: accuracy, an
    # absolute drop (0.02 = 2 points); regression models (loss only), a relative rise (0.02 = 2%).
    rollback_margin: float = Field(default=0.02, ge=0, le=1)
    auto_rollback: bool = True
    rollback_timeout_s: float = Field(default=30.0, gt=0)  # every target at the version by then
    history: int = Field(default=200, ge=1)  # rounds kept in memory (all of them are in the db)
    # SQLite file of round history and operator actions; empty: the user data dir, per swarm.
    db: str = ""
    # PostgreSQL instead of the SQLite file (postgresql://user:pw@host:port/dbname, one database per
    # swarm): several fleet processes may share it, one leads (api/fleet/leadership.py).
    database: str = Field(default="", repr=False)
    # How often a follower tries to take the lead and the leader checks that it still holds it.
    leader_check_s: float = Field(default=0.5, gt=0, le=60)
    tick_s: float = Field(default=0.25, gt=0)  # how often deadlines and heartbeats are checked
    # How often the automatic-round policy (api/fleet/autorounds.py) is checked; a due round that
    # must wait (the swarm is busy) is tried again at the next check.
    auto_check_s: float = Field(default=5.0, gt=0, le=3600)
    # Device image catalogue (api/fleet/images.py): off when empty; uploads must verify with image_keys.
    images_dir: str = ""
    image_keys: list[str] = Field(default_factory=list)
    # Image roll-outs (api/fleet/rollouts.py): a stage (the canary, then the rest) fails when one of
    # its nodes has not downloaded, flashed, restarted and passed its health check by then.
    rollout_stage_timeout_s: float = Field(default=900.0, gt=0)
    # The fleet's address as the nodes reach it (the download URL in image commands); empty: the
    # address the operator's roll-out request came in on.
    public_url: str = ""
    # Enrolment (api/fleet/enrollment.py): the broker URL handed to accepted devices (empty: ``broker``
    # without its credentials), and the dynamic-security admin URL (mqtt://ADMIN:PW@host:port) through
    # which the fleet makes and deletes devices' broker clients (empty: it makes none).
    device_broker: str = ""
    dynsec_admin: str = Field(default="", repr=False)

    # Asynchronous rounds (federation/PROTOCOL.md section 13): with async_params set (an artifact
    # directory or its params.npz: version 0, the parameters the nodes' images ship), the fleet
    # aggregates the updates of nodes running [training] sync = "async": a new version every
    # async_buffer updates, updates more than async_max_staleness versions behind refused.
    async_params: str = ""
    async_buffer: int = Field(default=4, ge=1, le=256)
    async_max_staleness: int = Field(default=4, ge=0, le=1000)
    async_refresh_s: float = Field(default=20.0, gt=0, le=50)  # < the signatures' 60 s freshness

    def db_path(self) -> Path:
        """Where the fleet keeps its durable state (``db``, or a per-swarm file in the user data dir)."""
        if self.db:
            return Path(self.db)
        import platformdirs

        return Path(platformdirs.user_data_dir("fractal-edge")) / f"fleet-{self.swarm}.sqlite"

    def store_target(self) -> str:
        """The fleet's database: the PostgreSQL URL when set, else the SQLite file."""
        return self.database or str(self.db_path())

    @field_validator("database")
    @classmethod
    def _postgres_url(cls, v: str) -> str:
        if v and not v.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (leave it empty for the SQLite file)")
        return v

    @field_validator("swarm")
    @classmethod
    def _topic_safe(cls, v: str) -> str:
        return validate_id(v, "swarm id")  # it becomes an MQTT topic level
