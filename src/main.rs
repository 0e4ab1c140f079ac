use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    limit_malloc_arenas();
    seedlock::cli::main(seedlock::cli::Cli::parse())
}

/// glibc's malloc gives every thread that allocates under contention an arena of its own (up
/// to eight per core) and keeps what is freed in it: with a parser per core, the blocking pool
/// and the runtime's workers, that was about a fifth of a crawling instance's resident memory
/// (BENCHMARKS.md, "Peak memory"). Two arenas keep it bounded; set before the first thread
/// starts. An operator's own `MALLOC_ARENA_MAX` (glibc reads it itself) wins.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only changes the allocator's tuning; nothing else runs yet.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
    }
}
