use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    seedlock::cli::main(seedlock::cli::Cli::parse())
}
