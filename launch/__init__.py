"""What every program of `experiments/` and `benchmarks/` shares: `import launch`, then `launch.<name>`.

    cli          the command line: flags whose every refusal is one line, the `--config` flag, flag checks,
                 the host devices a config asks for, `run(main)`
    main         `@program` over a program's `def main():`: one-line errors and exit status, quiet library logs,
                 `read_lines`, `machine_info`
    final_eval   the final evaluation a training program prints and writes
    huge_pages   the restart with glibc huge pages, below
    docblock     generated blocks in docs (between markers)

The one side effect of importing this package: when Python imports it to run `python -m experiments.<program>`
or `python -m benchmarks.<program>` (both packages' `__init__` import it first), the process restarts itself
once with glibc huge pages (`huge_pages`) before anything heavy is imported. Any other import has none.
"""

from launch import huge_pages

if huge_pages.starting_as_program():
  huge_pages.maybe_reexecute()

# After the restart, so that a restarting program has imported nothing heavy (JAX, TensorFlow) twice.
from launch.cli import (check_files_exist, check_flags, check_list_choices, check_output_files,  # noqa: E402
                        check_ranges, define_config_flag, parse_flags, run, set_cpu_devices, skip_absent_tpu)
from launch.final_eval import report_final_eval  # noqa: E402
from launch.main import USER_ERRORS, fail, machine_info, program, read_lines, setup_logging  # noqa: E402

__all__ = ["USER_ERRORS", "check_files_exist", "check_flags", "check_list_choices", "check_output_files",
           "check_ranges", "define_config_flag", "fail", "machine_info", "parse_flags", "program", "read_lines",
           "report_final_eval", "run", "set_cpu_devices", "setup_logging", "skip_absent_tpu"]
