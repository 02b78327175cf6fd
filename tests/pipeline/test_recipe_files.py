"""A recipe file never runs code (issue 37, class 8): a file read from a ``--config-dir`` (or any
folder outside ``configs/``) may not name callbacks, set a job's environment, pick a launcher or
sweeper we do not ship (or hide an object below one), add search-path folders, or make the
logging config call code. Each is refused in one line naming the file, before Hydra instantiates
anything; each attack would create a marker file, which the tests assert was not created. The
command line stays trusted operator input."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipeline.config import check_recipe_file, trusted_source
from tests.pipeline.test_errors import assert_one_error_line, cli

# An override that fails the job's own start-up checks at once: should a file's code get past the
# check, the run still stops quickly (after the code ran and made the marker).
STOP = "bench.repeats=0"


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def copy_marker(marker: Path, indent: str = "      ") -> str:
    """YAML settings of a ``shutil.copyfile`` call whose running creates ``marker``."""
    return f"{indent}_target_: shutil.copyfile\n{indent}src: {__file__}\n{indent}dst: {marker}\n"


def refused(result: subprocess.CompletedProcess[str], file: Path, key: str) -> None:
    line = assert_one_error_line(result, 2, str(file))
    assert key in line and "a recipe file never runs code" in line, line


@pytest.fixture
def recipes(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(a working folder, a config folder in it, the marker path)."""
    work = tmp_path / "work"
    (work / "recipes").mkdir(parents=True)
    return work, work / "recipes", tmp_path / "MARKER"


def test_a_global_package_callback_is_refused_before_it_runs(recipes: tuple[Path, Path, Path]) -> None:
    work, folder, marker = recipes
    file = write(
        folder, "quant/evil.yaml", f"# @package _global_\nhydra:\n  callbacks:\n    x:\n{copy_marker(marker)}"
    )
    refused(cli(work, "--config-dir", str(folder), "quant=evil", STOP), file, "hydra.callbacks.x")
    assert not marker.exists()


def test_a_callback_in_a_primary_recipe_file_is_refused(recipes: tuple[Path, Path, Path]) -> None:
    work, folder, marker = recipes
    text = f"defaults:\n  - pipeline\n  - _self_\nhydra:\n  callbacks:\n    x:\n{copy_marker(marker)}"
    file = write(folder, "mine.yaml", text)
    refused(cli(work, "--config-dir", str(folder), "--config-name", "mine", STOP), file, "hydra.callbacks.x")
    assert not marker.exists()


def test_a_file_may_name_our_own_callbacks(recipes: tuple[Path, Path, Path]) -> None:
    work, folder, _ = recipes
    text = (
        "defaults:\n  - pipeline\n  - _self_\nhydra:\n  callbacks:\n    again:\n"
        "      _target_: pipeline.nightly.SweepStatus\n"
    )
    write(folder, "mine.yaml", text)
    result = cli(work, "--config-dir", str(folder), "--config-name", "mine", "--cfg", "hydra")
    assert result.returncode == 0, result.stderr[-2000:]


def test_env_set_in_a_file_is_refused(recipes: tuple[Path, Path, Path]) -> None:
    """The benchmark child would import this sitecustomize.py (it makes the marker)."""
    work, folder, marker = recipes
    write(folder, "sitecustomize.py", f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    text = f"# @package _global_\nhydra:\n  job:\n    env_set:\n      PYTHONPATH: {folder}\n"
    file = write(folder, "quant/env.yaml", text)
    refused(cli(work, "--config-dir", str(folder), "quant=env", STOP), file, "hydra.job.env_set")
    assert not marker.exists()


def test_a_run_folder_outside_the_launch_folder_from_a_file_is_refused(
    recipes: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """Hydra would make the victim folder and write its .hydra/ and log there before the job."""
    work, folder, _ = recipes
    victim = tmp_path / "victim"
    file = write(folder, "quant/away.yaml", f"# @package _global_\nhydra:\n  run:\n    dir: {victim}/run\n")
    result = cli(work, "--config-dir", str(folder), "quant=away", STOP)
    line = assert_one_error_line(result, 2, str(file))
    assert "hydra.run.dir='/tmp/" in line and "is absolute" in line and "never writes outside" in line, line
    assert not victim.exists()
    result = cli(work, "--config-dir", str(folder), f"hydra.run.dir={victim}/run", STOP)  # trusted
    assert result.returncode == 2 and (victim / "run" / ".hydra").is_dir(), result.stderr[-500:]


def test_a_resolver_in_a_files_defaults_list_is_refused(
    recipes: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hydra resolves a defaults list (and drops it) before the file's config is checked: the
    environment would choose the recipe (QUANT=int8 picks quant=int8)."""
    work, folder, _ = recipes
    monkeypatch.setenv("QUANT", "int8")
    text = "defaults:\n  - pipeline\n  - override quant: ${oc.env:QUANT}\n  - _self_\n"
    file = write(folder, "mine.yaml", text)
    result = cli(work, "--config-dir", str(folder), "--config-name", "mine", "--cfg", "job")
    line = assert_one_error_line(result, 2, str(file))
    assert "defaults: ${oc.env:QUANT} calls resolver oc.env" in line and "never lets the environment" in line
    write(folder, "plain.yaml", "defaults:\n  - pipeline\n  - override quant: int8\n  - _self_\n")
    result = cli(work, "--config-dir", str(folder), "--config-name", "plain", "--cfg", "job")
    assert result.returncode == 0 and "passes.recipes.Int8Recipe" in result.stdout, result.stderr[-2000:]


def test_env_set_through_a_hydra_group_file_is_refused(recipes: tuple[Path, Path, Path]) -> None:
    work, folder, _ = recipes
    file = write(
        folder, "hydra/env/mine.yaml", f"# @package hydra\njob:\n  env_set:\n    PYTHONPATH: {folder}\n"
    )
    refused(cli(work, "--config-dir", str(folder), "hydra/env=mine", STOP), file, "hydra.job.env_set")


def test_an_object_below_the_launcher_is_refused(recipes: tuple[Path, Path, Path]) -> None:
    """Hydra instantiates a launcher's config recursively: the nested call would run first."""
    work, folder, marker = recipes
    text = "_target_: hydra._internal.core_plugins.basic_launcher.BasicLauncher\nx:\n" + copy_marker(
        marker, "  "
    )
    file = write(folder, "hydra/launcher/mine.yaml", text)
    result = cli(work, "-m", "--config-dir", str(folder), "hydra/launcher=mine", STOP)
    refused(result, file, "hydra.launcher.x._target_")
    assert not marker.exists()


def test_a_launcher_we_do_not_ship_is_refused(recipes: tuple[Path, Path, Path]) -> None:
    work, folder, _ = recipes
    file = write(folder, "hydra/launcher/mine.yaml", "_target_: hydra_plugins.elsewhere.Launcher\n")
    result = cli(work, "-m", "--config-dir", str(folder), "hydra/launcher=mine", STOP)
    refused(result, file, "hydra.launcher._target_=hydra_plugins.elsewhere.Launcher")


def test_submitit_setup_commands_in_a_file_are_refused(recipes: tuple[Path, Path, Path]) -> None:
    work, folder, marker = recipes
    text = f"defaults:\n  - submitit_slurm\nsetup:\n  - touch {marker}\n"
    file = write(folder, "hydra/launcher/mine.yaml", text)
    result = cli(work, "-m", "--config-dir", str(folder), "hydra/launcher=mine", STOP)
    refused(result, file, "hydra.launcher.setup")
    assert not marker.exists()


def test_an_object_below_the_sweeper_is_refused(recipes: tuple[Path, Path, Path]) -> None:
    work, folder, marker = recipes
    text = (
        "# @package hydra.sweeper\n_target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "max_batch_size: null\nparams: null\nx:\n" + copy_marker(marker, "  ")
    )
    file = write(folder, "quant/sweep.yaml", text)
    refused(
        cli(work, "-m", "--config-dir", str(folder), "quant=sweep", STOP), file, "hydra.sweeper.x._target_"
    )
    assert not marker.exists()


def test_sweeper_params_that_set_hydra_are_refused(recipes: tuple[Path, Path, Path]) -> None:
    """Sweep params become every job's overrides, as if typed on the command line."""
    work, folder, _ = recipes
    text = (
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n"
        f"      hydra.job.env_set.PYTHONPATH: {folder}\n"
    )
    file = write(folder, "quant/sweep.yaml", text)
    result = cli(work, "-m", "--config-dir", str(folder), "quant=sweep", STOP)
    refused(result, file, "hydra.sweeper.params.hydra.job.env_set.PYTHONPATH")


def test_overrides_in_a_file_are_refused(recipes: tuple[Path, Path, Path]) -> None:
    """``hydra.overrides.hydra`` is replayed as the command line of every job of a multirun."""
    work, folder, _ = recipes
    text = (
        "# @package _global_\nhydra:\n  overrides:\n    hydra:\n"
        f"      - hydra.job.env_set.PYTHONPATH={folder}\n"
    )
    file = write(folder, "quant/replay.yaml", text)
    refused(cli(work, "-m", "--config-dir", str(folder), "quant=replay", STOP), file, "hydra.overrides")


def test_a_logging_factory_in_a_file_is_refused(recipes: tuple[Path, Path, Path]) -> None:
    """``logging.config.dictConfig`` calls a handler's ``()`` factory when the job starts."""
    work, folder, marker = recipes
    text = (
        f"# @package _global_\nhydra:\n  job_logging:\n    handlers:\n      evil:\n"
        f"        '()': shutil.copyfile\n        src: {__file__}\n        dst: {marker}\n"
    )
    file = write(folder, "quant/log.yaml", text)
    refused(
        cli(work, "--config-dir", str(folder), "quant=log", STOP), file, "hydra.job_logging.handlers.evil.()"
    )
    assert not marker.exists()


def test_a_node_interpolated_into_the_logging_config_is_refused(recipes: tuple[Path, Path, Path]) -> None:
    """The factory hides in an app node (``registry`` takes any mapping) and is pulled into the
    logging config by an interpolation: refused where it is pulled in."""
    work, folder, marker = recipes
    text = (
        f"# @package _global_\nregistry:\n  h:\n    '()': shutil.copyfile\n    src: {__file__}\n"
        f"    dst: {marker}\nhydra:\n  job_logging:\n    handlers:\n      evil: ${{registry.h}}\n"
    )
    file = write(folder, "quant/interp.yaml", text)
    result = cli(work, "--config-dir", str(folder), "quant=interp", STOP)
    refused(result, file, "hydra.job_logging.handlers.evil=${registry.h} interpolates")
    assert not marker.exists()


def test_a_search_path_from_a_file_is_refused(recipes: tuple[Path, Path, Path]) -> None:
    work, folder, marker = recipes
    package = work / "evilpkg"
    package.mkdir()
    (package / "__init__.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    other = work / "other"
    write(
        other, "quant/evil.yaml", f"# @package _global_\nhydra:\n  callbacks:\n    x:\n{copy_marker(marker)}"
    )
    text = f"defaults:\n  - pipeline\n  - _self_\nhydra:\n  searchpath:\n    - pkg://evilpkg\n    - file://{other}\n"
    file = write(folder, "mine.yaml", text)
    result = cli(work, "--config-dir", str(folder), "--config-name", "mine", "quant=evil", STOP)
    refused(result, file, "hydra.searchpath")
    assert not marker.exists()


def test_the_command_line_is_trusted(recipes: tuple[Path, Path, Path]) -> None:
    """The same settings given as overrides are the operator's, and pass the check."""
    work, folder, _ = recipes
    other = work / "other"
    write(other, "quant/mine.yaml", "defaults:\n  - int8\n  - _self_\n")
    overrides = [
        "+hydra.callbacks.x._target_=pipeline.nightly.SweepStatus",
        "+hydra.job.env_set.FOO=bar",
        f"hydra.searchpath=[file://{other}]",
        "quant=mine",
    ]
    result = cli(work, "--config-dir", str(folder), *overrides, "--cfg", "hydra")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "FOO: bar" in result.stdout and "pipeline.nightly.SweepStatus" in result.stdout


def test_a_plain_recipe_file_still_works(recipes: tuple[Path, Path, Path]) -> None:
    work, folder, _ = recipes
    write(folder, "quant/mine.yaml", "defaults:\n  - int8\n  - _self_\n")
    write(folder, "hydra/launcher/mine.yaml", "defaults:\n  - submitit_slurm\npartition: gpu\nmem_gb: 32\n")
    result = cli(work, "--config-dir", str(folder), "quant=mine", "hydra/launcher=mine", "--cfg", "hydra")
    assert result.returncode == 0, result.stderr[-2000:]


def test_only_the_shipped_configs_are_trusted(tmp_path: Path) -> None:
    from pipeline.config import CONFIG_DIR

    assert trusted_source(f"file://{CONFIG_DIR}") and trusted_source("pkg://hydra.conf")
    assert trusted_source("structured://") and not trusted_source(f"file://{tmp_path}")
    check_recipe_file("x.yaml", None)  # nothing to check


@pytest.mark.parametrize(
    ("hydra", "key"),
    [
        ({"launcher": {"ray": {"init": {"runtime_env": {"env_vars": {"PYTHONPATH": "/x"}}}}}}, "runtime_env"),
        ({"launcher": {"srun_args": ["--export=ALL"]}}, "hydra.launcher.srun_args"),
        ({"sweeper": {"_target_": "hydra_plugins.other.Sweeper"}}, "hydra.sweeper._target_=hydra_plugins"),
        ({"sweeper": {"params": {"+hydra/launcher": "joblib"}}}, "hydra.sweeper.params.+hydra/launcher"),
        ({"callbacks": {"x": {"_target_": "pipeline.cluster.SweepChecks", "y": 1}}}, "hydra.callbacks.x"),
        ({"job_logging": {"handlers": {"h": {"class": "mypkg.Handler"}}}}, "class=mypkg.Handler"),
        ({"job_logging": {"handlers": {"h": {"stream": "ext://mypkg.stream"}}}}, "ext://mypkg.stream"),
        ({"hydra_logging": {"filters": {"f": {"()": "mypkg.Filter"}}}}, "hydra.hydra_logging.filters.f.()"),
        (
            {"launcher": {"_target_": "${oc.create:{}}"}},
            "hydra.launcher._target_=${oc.create:{}} calls resolver",
        ),
        ({"searchpath": ["pkg://elsewhere"]}, "hydra.searchpath"),
        ({"job": {"env_copy": ["AWS_SECRET_ACCESS_KEY"]}}, "hydra.job.env_copy copies the environment"),
        ({"run": {"dir": "/etc/cron.d"}}, "hydra.run.dir=/etc/cron.d is absolute"),
        ({"run": {"dir": "~/.ssh"}}, "hydra.run.dir=~/.ssh is absolute"),
        ({"sweep": {"dir": "${launch_dir:}/../../x"}}, "hydra.sweep.dir=${launch_dir:}/../../x"),
        ({"sweep": {"subdir": "a/../../../b"}}, "hydra.sweep.subdir=a/../../../b"),
        ({"run": {"dir": "${pipeline.models_dir}/run"}}, "hydra.run.dir=${pipeline.models_dir}/run"),
        ({"output_subdir": "../../.config"}, "hydra.output_subdir=../../.config"),
    ],
)
def test_each_way_a_file_could_run_code_is_named(hydra: dict, key: str) -> None:
    from omegaconf import OmegaConf

    from pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        check_recipe_file("/r/quant/x.yaml", OmegaConf.create({"hydra": hydra}))
    message = str(error.value)
    assert message.startswith("/r/quant/x.yaml: ") and key in message and "\n" not in message, message


def test_plain_hydra_settings_in_a_file_pass() -> None:
    from omegaconf import OmegaConf

    plain = {
        "run": {"dir": "runs/${now:%H}"},
        "sweep": {"dir": "${launch_dir:}/artifacts/multirun/${now:%H}", "subdir": "${hydra.job.num}"},
        "output_subdir": ".hydra",
        "job": {"chdir": False, "name": "nightly"},
        "launcher": {
            "_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
            "n_jobs": 2,
        },
        "sweeper": {"params": {"quant": "int8,fp8"}},
        "job_logging": {"version": 1, "root": {"level": "DEBUG"}, "loggers": {"lm_eval": {"level": 10}}},
        "hydra_logging": {"loggers": {"hydra": {"level": "WARNING"}}},
        "callbacks": {"status": {"_target_": "pipeline.nightly.SweepStatus"}},
    }
    check_recipe_file("/r/x.yaml", OmegaConf.create({"hydra": plain}))
