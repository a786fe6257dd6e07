//! Config keys as an operator writes them, shared by both binaries' config errors.

/// The `config` crate writes nested array keys as `streams[1]filters[0]`; TOML (and our
/// errors) write `streams[1].filters[0]`.
pub fn dotted(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 4);
    let mut after_bracket = false;
    for c in key.chars() {
        if after_bracket && c != '.' && c != '[' {
            out.push('.');
        }
        after_bracket = c == ']';
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::dotted;

    #[test]
    fn array_keys_are_dotted_as_in_toml() {
        assert_eq!(
            dotted("streams[0]scale.target_records_per_s"),
            "streams[0].scale.target_records_per_s"
        );
        assert_eq!(dotted("a[1][2]b"), "a[1][2].b");
        assert_eq!(dotted("listen.http"), "listen.http");
    }
}
