//! What several engine test binaries share.

use quiver_gguf::GgufFile;
use std::sync::Arc;

/// The real SmolLM2 test model (scripts/test fetches it).
pub fn smollm2() -> Arc<GgufFile> {
    let p = quiver_hub::alias_path("smollm2-135m");
    assert!(
        p.is_file(),
        "{} is missing: run scripts/test (it fetches the test models)",
        p.display()
    );
    Arc::new(GgufFile::open(&p).unwrap())
}
