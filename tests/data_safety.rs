//! Issue 24: no data loss and no silent failure. Output files are never put in place of a
//! device, FIFO or symlink; resume refuses what it cannot resume, keeps what it did not
//! write, and checks the run's settings against the checkpoint; non-finite numbers stop
//! the run instead of being checkpointed.

mod common;

use common::{root, run};
use std::os::unix::fs::FileTypeExt;

/// `-o` through a symlink writes the link's target (the link stays a link); `-o FIFO`
/// writes into the FIFO (it stays a FIFO, the reader gets the text); `-o -` is stdout.
#[test]
fn output_into_symlink_fifo_and_stdout() {
    let dir = tempfile::tempdir().unwrap();
    let (_, schema, _) = run(&["schema"]);
    assert!(schema.contains("\"$schema\""), "{schema}");

    // A symlink (relative) to a file that exists.
    let target = dir.path().join("real.json");
    std::fs::write(&target, "old").unwrap();
    let link = dir.path().join("link.json");
    std::os::unix::fs::symlink("real.json", &link).unwrap();
    let (code, _, err) = run(&["schema", "-o", link.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let m = std::fs::symlink_metadata(&link).unwrap();
    assert!(
        m.file_type().is_symlink(),
        "the symlink was replaced by a file"
    );
    assert_eq!(std::fs::read_to_string(&target).unwrap(), schema);

    // A FIFO with a reader on the other end.
    let fifo = dir.path().join("pipe");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let f2 = fifo.clone();
    std::thread::spawn(move || {
        let _ = tx.send(std::fs::read_to_string(&f2).unwrap_or_default());
    });
    let (code, _, err) = run(&["schema", "-o", fifo.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let m = std::fs::symlink_metadata(&fifo).unwrap();
    assert!(
        m.file_type().is_fifo(),
        "the FIFO was replaced by a regular file"
    );
    let got = rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("the FIFO's reader got the text");
    assert_eq!(got, schema);

    // `-o -` is stdout, not a file named `-`.
    let (code, out, err) = run(&["schema", "-o", "-"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, schema);
    assert!(!root().join("-").exists(), "a file named `-` was written");
}
