//! What the tests that run `kvpipe serve` as a process share.

use std::io::BufRead;

/// The address `kvpipe serve` prints as its first line on stderr ("kvpipe serve: listening on
/// ADDR"); panics on any other first line.
pub(crate) fn listening_addr(stderr: &mut impl BufRead) -> String {
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    line.trim()
        .strip_prefix("kvpipe serve: listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string()
}
