"""The run directory contract: ``runs/<name>/`` and what lives in it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autotune.config.schema import ConfigError, TuneConfig, load_config
from autotune.run.files import atomic_write


@dataclass(frozen=True)
class RunDir:
    """Paths of one run.

    ``config.yaml`` (resolved config), ``trials.sqlite`` (trial store), ``tb/`` (TensorBoard),
    ``checkpoints/`` (agent), ``best/`` (exported winner), ``summary.json``.
    """

    root: Path

    @property
    def config(self) -> Path:
        """The resolved config."""
        return self.root / "config.yaml"

    @property
    def store(self) -> Path:
        """The trial store."""
        return self.root / "trials.sqlite"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files."""
        return self.root / "tb"

    @property
    def checkpoints(self) -> Path:
        """Agent checkpoints."""
        return self.root / "checkpoints"

    @property
    def best(self) -> Path:
        """The exported winner."""
        return self.root / "best"

    @property
    def summary(self) -> Path:
        """The run summary."""
        return self.root / "summary.json"

    @classmethod
    def new(cls, root: Path) -> RunDir:
        """The run directory ``root`` for a new run, before anything is measured for it.

        Raises:
            ConfigError: The run already has trials (resume it or choose another name).
        """
        run = cls(root)
        if run.store.exists():
            raise ConfigError(
                f"{run.root} already holds a run: continue it with `autotune resume {run.root}`, "
                f"or set another name (--set name=...)"
            )
        return run

    @classmethod
    def create(cls, root: Path, resolved_config: str) -> RunDir:
        """Creates the run directory and writes the resolved config.

        Args:
            root: The run directory (``TuneConfig.run_dir``).
            resolved_config: The config as YAML (``dump_config``), its folders absolute
                (``TuneConfig.with_absolute_paths``), so the run resumes from any working directory.

        Raises:
            ConfigError: The run already has trials (resume it or choose another name), or the directory
                cannot be written.
        """
        run = cls.new(root)
        try:
            run.root.mkdir(parents=True, exist_ok=True)
            atomic_write(run.config, resolved_config)
        except OSError as error:
            raise ConfigError(f"cannot write the run directory {run.root}: {error}") from error
        return run

    @classmethod
    def open(cls, path: str | Path) -> tuple[RunDir, TuneConfig]:
        """Opens an existing run and its resolved config.

        Raises:
            ConfigError: There is no run there.
        """
        run = cls(Path(path))
        if not run.config.is_file():
            raise ConfigError(f"{run.root} is not a run directory (no config.yaml); runs live in runs/<name>")
        return run, load_config(run.config)
