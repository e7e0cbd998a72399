//! The dataplane crate's layers import only the layers below them (the
//! order in `src/lib.rs`'s header): no import circle. Read from the
//! source: every `crate::<module>` a module's code (not its comments)
//! names.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Lowest first.
const LAYERS: &[&str] = &[
    "model",
    "generictables",
    "rules",
    "status",
    "metrics",
    "backends",
    "interfaces",
    "managers",
    "session",
    "sync_loop",
];

fn files(at: &Path, out: &mut Vec<PathBuf>) {
    if at.is_dir() {
        for e in std::fs::read_dir(at).unwrap() {
            files(&e.unwrap().path(), out);
        }
    } else if at.is_file() && at.extension().is_some_and(|e| e == "rs") {
        out.push(at.to_path_buf());
    }
}

/// The top-level modules `module`'s code names, itself left out. Test
/// files (`tests.rs`, `tests/`) may reach anywhere.
fn imports(src: &Path, module: &str) -> BTreeSet<String> {
    let mut paths = Vec::new();
    files(&src.join(format!("{module}.rs")), &mut paths);
    files(&src.join(module), &mut paths);
    let mut out = BTreeSet::new();
    for p in paths {
        if p.file_name().is_some_and(|n| n == "tests.rs")
            || p.components().any(|c| c.as_os_str() == "tests")
        {
            continue;
        }
        for line in std::fs::read_to_string(&p).unwrap().lines() {
            let code = line.split("//").next().unwrap_or("");
            for (i, _) in code.match_indices("crate::") {
                let rest = &code[i + "crate::".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != module {
                    out.insert(name);
                }
            }
        }
    }
    out
}

#[test]
fn each_layer_imports_only_those_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut wrong = Vec::new();
    for (at, module) in LAYERS.iter().enumerate() {
        for named in imports(&src, module) {
            match LAYERS.iter().position(|l| *l == named) {
                Some(p) if p < at => {}
                Some(_) => wrong.push(format!("{module} → {named} (above it)")),
                None => wrong.push(format!("{module} → {named} (not in LAYERS)")),
            }
        }
    }
    assert!(wrong.is_empty(), "layering broken:\n{}", wrong.join("\n"));
}

/// The check itself finds an import upwards (so that it cannot pass by
/// reading nothing).
#[test]
fn the_check_sees_imports() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let m = imports(&src, "managers");
    assert!(m.contains("backends") && m.contains("model"), "{m:?}");
    let s = imports(&src, "sync_loop");
    assert!(s.contains("managers"), "{s:?}");
}
