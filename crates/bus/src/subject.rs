//! Subject syntax, validated identically for both implementations, and NATS wildcard matching.
//!
//! A subject is a non-empty list of non-empty tokens separated by `.`, without whitespace or
//! control characters. When subscribing, a token that is exactly `*` matches any one token and a
//! last token that is exactly `>` matches one or more trailing tokens. Publish subjects (and reply
//! subjects) must not contain wildcard tokens. Characters `*` and `>` inside a longer token are
//! literal, as in NATS.

use crate::BusError;

/// Checks a subject used to publish, request or reply.
pub fn validate_publish(subject: &str) -> Result<(), BusError> {
    validate_tokens(subject, "publish")?;
    if let Some(w) = subject.split('.').find(|t| is_wildcard(t)) {
        return Err(BusError::InvalidSubject(format!(
            "publish subject '{subject}' contains the wildcard token '{w}'; \
             wildcards are only valid when subscribing"
        )));
    }
    Ok(())
}

/// Checks a subject used to subscribe: wildcards allowed, `>` only as the last token.
pub fn validate_subscribe(subject: &str) -> Result<(), BusError> {
    validate_tokens(subject, "subscribe")?;
    let mut tokens = subject.split('.').peekable();
    while let Some(t) = tokens.next() {
        if t == ">" && tokens.peek().is_some() {
            return Err(BusError::InvalidSubject(format!(
                "subscribe subject '{subject}' has '>' before its last token; \
                 '>' matches the rest of a subject and must come last"
            )));
        }
    }
    Ok(())
}

/// Checks a queue group name: non-empty, no whitespace or control characters.
pub fn validate_queue_group(group: &str) -> Result<(), BusError> {
    if group.is_empty() {
        return Err(BusError::InvalidSubject(
            "queue group name is empty".to_string(),
        ));
    }
    if let Some(c) = group.chars().find(|c| is_forbidden_char(*c)) {
        return Err(BusError::InvalidSubject(format!(
            "queue group name {group:?} contains the forbidden character {c:?} \
             (no whitespace or control characters)"
        )));
    }
    Ok(())
}

/// Whether a (valid) subscribe subject contains a wildcard token.
pub fn has_wildcard(subject: &str) -> bool {
    subject.split('.').any(is_wildcard)
}

/// Whether the subscribe `pattern` matches the publish `subject` (both assumed valid).
pub fn matches(pattern: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split('.');
    for p in pattern.split('.') {
        if p == ">" {
            return subject_tokens.next().is_some();
        }
        match subject_tokens.next() {
            Some(t) if p == "*" || p == t => {}
            _ => return false,
        }
    }
    subject_tokens.next().is_none()
}

fn is_wildcard(token: &str) -> bool {
    token == "*" || token == ">"
}

fn is_forbidden_char(c: char) -> bool {
    c.is_whitespace() || c.is_control()
}

fn validate_tokens(subject: &str, what: &str) -> Result<(), BusError> {
    if subject.is_empty() {
        return Err(BusError::InvalidSubject(format!("{what} subject is empty")));
    }
    if let Some(c) = subject.chars().find(|c| is_forbidden_char(*c)) {
        return Err(BusError::InvalidSubject(format!(
            "{what} subject {subject:?} contains the forbidden character {c:?} \
             (no whitespace or control characters)"
        )));
    }
    if subject.split('.').any(str::is_empty) {
        return Err(BusError::InvalidSubject(format!(
            "{what} subject '{subject}' has an empty token (leading, trailing or doubled '.')"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_subjects() {
        for ok in [
            "a",
            "a.b.c",
            "_INBOX.abc123",
            "kv.events.w-1",
            "a*b.c>",
            "ü.x",
        ] {
            assert!(validate_publish(ok).is_ok(), "{ok}");
        }
        for bad in [
            "", ".", "a.", ".a", "a..b", "a b", "a\tb", "a\nb", "a\r", "a.*", "*", ">", "a.>",
            "a.*.b", "a\u{0}b",
        ] {
            assert!(
                matches!(validate_publish(bad), Err(BusError::InvalidSubject(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn subscribe_subjects() {
        for ok in ["a", "a.*", "*", ">", "a.>", "*.b.>", "a.*.c", "a*.b"] {
            assert!(validate_subscribe(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a..b", "a.>.b", ">.a", "a b", " ", "a.", ".>"] {
            assert!(
                matches!(validate_subscribe(bad), Err(BusError::InvalidSubject(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn queue_groups() {
        assert!(validate_queue_group("workers").is_ok());
        assert!(validate_queue_group("a.b-c").is_ok());
        assert!(validate_queue_group("").is_err());
        assert!(validate_queue_group("a b").is_err());
    }

    #[test]
    fn wildcard_detection() {
        assert!(has_wildcard("a.*"));
        assert!(has_wildcard(">"));
        assert!(!has_wildcard("a*.b>"));
        assert!(!has_wildcard("a.b"));
    }

    #[test]
    fn matching() {
        let cases: &[(&str, &str, bool)] = &[
            ("a", "a", true),
            ("a", "b", false),
            ("a.b", "a", false),
            ("a", "a.b", false),
            ("a.*", "a.b", true),
            ("a.*", "a", false),
            ("a.*", "a.b.c", false),
            ("*.b", "a.b", true),
            ("*", "a", true),
            ("*", "a.b", false),
            ("a.>", "a.b", true),
            ("a.>", "a.b.c.d", true),
            ("a.>", "a", false),
            (">", "a", true),
            (">", "a.b.c", true),
            ("a.*.>", "a.b", false),
            ("a.*.>", "a.b.c", true),
            ("*.*", "a.b", true),
            ("a*", "ab", false),
            ("a*", "a*", true),
        ];
        for (pattern, subject, want) in cases {
            assert_eq!(matches(pattern, subject), *want, "{pattern} vs {subject}");
        }
    }

    /// A brute-force cross-check: matching agrees with a token-by-token reference over every
    /// pattern and subject built from a small alphabet.
    #[test]
    fn matching_agrees_with_reference() {
        fn reference(p: &[&str], s: &[&str]) -> bool {
            match (p.split_first(), s.split_first()) {
                (None, None) => true,
                (Some((&">", rest)), Some(_)) => rest.is_empty(),
                (Some((&pt, prest)), Some((&st, srest))) => {
                    (pt == "*" || pt == st) && reference(prest, srest)
                }
                _ => false,
            }
        }
        fn all(alphabet: &[&'static str], max_len: usize) -> Vec<Vec<&'static str>> {
            let mut out: Vec<Vec<&str>> = vec![];
            let mut layer: Vec<Vec<&str>> = vec![vec![]];
            for _ in 0..max_len {
                let mut next = vec![];
                for l in &layer {
                    for a in alphabet {
                        let mut v = l.clone();
                        v.push(*a);
                        next.push(v);
                    }
                }
                out.extend(next.iter().cloned());
                layer = next;
            }
            out
        }
        let patterns: Vec<_> = all(&["a", "b", "*", ">"], 4)
            .into_iter()
            .filter(|p| validate_subscribe(&p.join(".")).is_ok())
            .collect();
        let subjects = all(&["a", "b", "c"], 4);
        for p in &patterns {
            for s in &subjects {
                assert_eq!(
                    matches(&p.join("."), &s.join(".")),
                    reference(p, s),
                    "{p:?} {s:?}"
                );
            }
        }
    }
}
