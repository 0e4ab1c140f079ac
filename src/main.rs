use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    tune_malloc();
    seedlock::cli::main(seedlock::cli::Cli::parse())
}

/// Allocations of this size and more are mapped on their own, and unmapped when freed.
const MMAP_THRESHOLD: i32 = 1 << 20;

/// Two settings of glibc's malloc, made before the first thread starts; an operator's own
/// `MALLOC_ARENA_MAX` or `MALLOC_MMAP_THRESHOLD_` (glibc reads them itself) wins.
///
/// - **Two arenas.** glibc gives every thread that allocates under contention an arena of its
///   own (up to eight per core) and keeps what is freed in it: with a parser per core, the
///   blocking pool and the runtime's workers, that was about a fifth of a crawling instance's
///   resident memory (BENCHMARKS.md, "Peak memory").
/// - **Large blocks mapped, at a fixed threshold.** The tables a pass holds for a while (the
///   listed items known stored, the evaluation's present and departures: megabytes at a
///   million items) then grow by remapping instead of copying, and go back to the system when
///   freed. glibc's own threshold moves up to 32 MiB as large blocks are freed, after which
///   such tables come out of the heap, a copy is made at each growth, and what is freed stays
///   resident.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let set = |name: &str, option: libc::c_int, value: libc::c_int| {
            if std::env::var_os(name).is_none() {
                // SAFETY: mallopt only changes the allocator's tuning; nothing else runs yet.
                unsafe {
                    libc::mallopt(option, value);
                }
            }
        };
        set("MALLOC_ARENA_MAX", libc::M_ARENA_MAX, 2);
        set(
            "MALLOC_MMAP_THRESHOLD_",
            libc::M_MMAP_THRESHOLD,
            MMAP_THRESHOLD,
        );
    }
}
