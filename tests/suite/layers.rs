//! The house's floors, read from the source: every module names only modules on lower floors
//! (`crate::NAME` anywhere in a file, doc links included), so there is no circle and no import
//! that runs back up. A wing's files may name each other. ARCHITECTURE.md ("Code map") lists the
//! same floors; a new module must be placed on one here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// From the ground up: a module may name only the modules before it.
const FLOORS: &[&str] = &[
    "ids",
    "urls",
    "clock",
    "redact",
    "backoff",
    "error",
    "demo_site",
    "extract",
    "http_client",
    "flow",
    "config",
    "seeds",
    "lock",
    "store",
    "metrics",
    "crawl",
    "runner",
    "ops",
    "daemon",
    "cli",
];

/// The top-level module a source file belongs to: `src/store/frontier.rs` → `store`.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let relative = file.strip_prefix(src).ok()?;
    let first = relative.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(name, "lib" | "main")).then(|| name.to_owned())
}

/// Every top-level module a file names as `crate::NAME` or inside `crate::{A, B::…}`.
fn named_modules(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (at, _) in text.match_indices("crate::") {
        // `seedlock::crate::` cannot occur; `$crate::` (macros) is not ours to judge.
        if text[..at].ends_with('$') {
            continue;
        }
        let rest = &text[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for part in group[..end].split(',') {
                let name = ident(part.trim());
                if !name.is_empty() {
                    names.insert(name);
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                names.insert(name);
            }
        }
    }
    names
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// What is wrong with a house of (file, module, text): modules on no floor, and each name of a
/// module that is not below the naming file's.
fn misplaced(files: &[(String, String, String)]) -> (BTreeSet<String>, Vec<String>) {
    let floor = |name: &str| FLOORS.iter().position(|f| *f == name);
    let mut unplaced = BTreeSet::new();
    let mut upward = Vec::new();
    for (file, module, text) in files {
        let Some(own) = floor(module) else {
            unplaced.insert(module.clone());
            continue;
        };
        for named in named_modules(text) {
            match floor(&named) {
                _ if named == *module => {}
                Some(theirs) if theirs < own => {}
                Some(_) => upward.push(format!(
                    "{file} (in `{module}`) names `crate::{named}`, which is not below it"
                )),
                None => {
                    unplaced.insert(named);
                }
            }
        }
    }
    (unplaced, upward)
}

#[test]
fn every_module_names_only_the_floors_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    sources(&src, &mut paths);
    paths.sort();
    let files: Vec<(String, String, String)> = paths
        .iter()
        .filter_map(|path| {
            let module = module_of(&src, path)?;
            let shown = path.strip_prefix(&src).unwrap().display().to_string();
            Some((shown, module, std::fs::read_to_string(path).unwrap()))
        })
        .collect();
    assert!(files.len() > 40, "read {} source files", files.len());
    let (unplaced, upward) = misplaced(&files);
    assert!(
        unplaced.is_empty(),
        "modules on no floor of tests/suite/layers.rs (place them): {unplaced:?}"
    );
    assert!(
        upward.is_empty(),
        "imports that run back up:\n{}",
        upward.join("\n")
    );
}

#[test]
fn the_reader_finds_plain_grouped_and_nested_names() {
    let text = "use crate::store::Store;\nuse crate::{ids::BotId, urls};\n/// [`x`]: crate::lock::hub\nfn f() { crate::error::Error::Cancelled; }\n$crate::not_ours";
    let found: Vec<String> = named_modules(text).into_iter().collect();
    assert_eq!(found, ["error", "ids", "lock", "store", "urls"]);
}

#[test]
fn a_name_that_runs_back_up_or_sits_on_no_floor_is_reported() {
    let house = [
        (
            "store/frontier.rs",
            "store",
            "use crate::crawl::fetch::Validators;",
        ),
        (
            "crawl/mod.rs",
            "crawl",
            "use crate::store::Store; use crate::crawl::queue;",
        ),
        ("store/mod.rs", "store", "use crate::attic::Thing;"),
    ]
    .map(|(f, m, t)| (f.to_owned(), m.to_owned(), t.to_owned()));
    let (unplaced, upward) = misplaced(&house);
    assert_eq!(
        upward,
        ["store/frontier.rs (in `store`) names `crate::crawl`, which is not below it"]
    );
    assert_eq!(unplaced.into_iter().collect::<Vec<_>>(), ["attic"]);
}

/// The files of `files` (path, text) outside the store that name the MongoDB driver, other than
/// `error.rs`, which turns the driver's errors into the crate's.
fn driver_outside_the_store(files: &[(String, String)]) -> Vec<String> {
    files
        .iter()
        .filter(|(path, text)| {
            !path.starts_with("store/") && path != "error.rs" && text.contains("mongodb::")
        })
        .map(|(path, _)| path.clone())
        .collect()
}

#[test]
fn only_the_store_talks_to_mongodb() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    sources(&src, &mut paths);
    let files: Vec<(String, String)> = paths
        .iter()
        .map(|path| {
            let shown = path.strip_prefix(&src).unwrap().display().to_string();
            (shown, std::fs::read_to_string(path).unwrap())
        })
        .collect();
    assert!(
        files.iter().any(|(path, _)| path.starts_with("store/")),
        "read the store"
    );
    let outside = driver_outside_the_store(&files);
    assert!(
        outside.is_empty(),
        "files outside src/store that use the driver: {outside:?}"
    );
}

#[test]
fn the_driver_check_reports_a_file_outside_the_store() {
    let house = [
        ("store/bots.rs", "use mongodb::Collection;"),
        ("error.rs", "impl From<mongodb::error::Error> for Error {}"),
        ("crawl/commit.rs", "let c: mongodb::Collection<Document>;"),
    ]
    .map(|(p, t)| (p.to_owned(), t.to_owned()));
    assert_eq!(driver_outside_the_store(&house), ["crawl/commit.rs"]);
}
