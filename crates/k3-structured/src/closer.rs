//! The shortest text that completes a JSON value begun by the text seen so far
//! ([`JsonCloser`]), by JSON's grammar alone: a string closed, a dangling key given `: null`, a
//! number or literal finished, the open arrays and objects closed. The engine uses it when a
//! JSON answer would otherwise be cut by `max_tokens`: in the last tokens of the budget it
//! offers the closer's next token, which the request's constraint may refuse (a schema can
//! require more than JSON does; then sampling goes on as before).

/// What the next byte may be, inside one container or at the top.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A value (the top, after `:` or after `,` in an array).
    Value,
    /// A value or `]` (right after `[`).
    ValueOrEnd,
    /// A key or `}` (right after `{`).
    KeyOrEnd,
    /// A key (after `,` in an object).
    Key,
    /// `:` after a key.
    Colon,
    /// `,` or the container's end, after a value.
    CommaOrEnd,
    /// The top value is complete.
    Done,
}

/// Where inside a scalar the text is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Scalar {
    None,
    /// Inside a string (a key when `key`), after a backslash (`escape`), or `hex` digits into
    /// a `\u` escape.
    String {
        key: bool,
        escape: bool,
        hex: Option<u8>,
    },
    /// Inside a number; `needs_digit` while the text ends in `-`, `.`, `e`, `e+` or `e-`.
    Number {
        needs_digit: bool,
    },
    /// Inside `true`, `false` or `null`: the letters still missing.
    Literal(&'static str),
}

/// The JSON text seen so far and the shortest way to complete it, written with the separators
/// the constraints use (`": "`, as Python's `json.dumps`).
#[derive(Debug, Clone)]
pub struct JsonCloser {
    /// The open containers: `true` for an object.
    stack: Vec<bool>,
    expect: Expect,
    scalar: Scalar,
    /// Text that is not JSON was seen: no closer.
    broken: bool,
}

impl Default for JsonCloser {
    fn default() -> Self {
        Self {
            stack: Vec::new(),
            expect: Expect::Value,
            scalar: Scalar::None,
            broken: false,
        }
    }
}

impl JsonCloser {
    /// Takes the next piece of text.
    pub fn push(&mut self, text: &str) {
        for byte in text.bytes() {
            if self.broken {
                return;
            }
            self.byte(byte);
        }
    }

    /// The shortest text completing the value (empty once it is complete), or `None` when the
    /// text seen is not the start of a JSON value or nothing has begun yet.
    pub fn suffix(&self) -> Option<String> {
        let begun =
            !(self.expect == Expect::Value && self.stack.is_empty() && self.scalar == Scalar::None);
        if self.broken || !begun {
            return None;
        }
        let mut out = String::new();
        let mut expect = self.expect;
        match &self.scalar {
            Scalar::String { key, escape, hex } => {
                if *escape {
                    out.push('n');
                }
                if let Some(n) = hex {
                    out.extend(std::iter::repeat_n('0', 4 - usize::from(*n)));
                }
                out.push('"');
                if *key {
                    out.push_str(": null");
                }
                expect = Expect::CommaOrEnd;
            }
            Scalar::Number { needs_digit } => {
                if *needs_digit {
                    out.push('0');
                }
                expect = Expect::CommaOrEnd;
            }
            Scalar::Literal(rest) => {
                out.push_str(rest);
                expect = Expect::CommaOrEnd;
            }
            Scalar::None => {}
        }
        match expect {
            Expect::Value | Expect::Key => {
                // After `,` (or `:`): a value is owed; an object's key needs one too.
                if expect == Expect::Key {
                    out.push_str("\"\": ");
                }
                out.push_str("null");
            }
            Expect::Colon => out.push_str(": null"),
            Expect::ValueOrEnd | Expect::KeyOrEnd | Expect::CommaOrEnd | Expect::Done => {}
        }
        for &object in self.stack.iter().rev() {
            out.push(if object { '}' } else { ']' });
        }
        Some(out)
    }

    fn byte(&mut self, b: u8) {
        match std::mem::replace(&mut self.scalar, Scalar::None) {
            Scalar::String { key, escape, hex } => {
                self.scalar = match (escape, hex) {
                    (_, Some(n)) if b.is_ascii_hexdigit() => Scalar::String {
                        key,
                        escape: false,
                        hex: (n < 3).then_some(n + 1),
                    },
                    (_, Some(_)) => return self.fail(),
                    (true, None) => match b {
                        b'u' => Scalar::String {
                            key,
                            escape: false,
                            hex: Some(0),
                        },
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Scalar::String {
                            key,
                            escape: false,
                            hex: None,
                        },
                        _ => return self.fail(),
                    },
                    (false, None) => match b {
                        b'"' => {
                            self.expect = if key {
                                Expect::Colon
                            } else {
                                Expect::CommaOrEnd
                            };
                            Scalar::None
                        }
                        b'\\' => Scalar::String {
                            key,
                            escape: true,
                            hex: None,
                        },
                        _ => Scalar::String {
                            key,
                            escape: false,
                            hex: None,
                        },
                    },
                };
                return;
            }
            Scalar::Number { needs_digit } => {
                if b.is_ascii_digit() {
                    self.scalar = Scalar::Number { needs_digit: false };
                    return;
                }
                if matches!(b, b'.' | b'e' | b'E') || (matches!(b, b'+' | b'-') && needs_digit) {
                    self.scalar = Scalar::Number { needs_digit: true };
                    return;
                }
                if needs_digit {
                    return self.fail();
                }
                self.expect = Expect::CommaOrEnd;
                // The byte ends the number: read it as what follows.
            }
            Scalar::Literal(rest) => {
                if rest.as_bytes().first() == Some(&b) {
                    if rest.len() > 1 {
                        self.scalar = Scalar::Literal(&rest[1..]);
                    } else {
                        self.expect = Expect::CommaOrEnd;
                    }
                    return;
                }
                return self.fail();
            }
            Scalar::None => {}
        }
        if b.is_ascii_whitespace() {
            return;
        }
        match self.expect {
            Expect::Value | Expect::ValueOrEnd => match b {
                b']' if self.expect == Expect::ValueOrEnd => self.close(false),
                b'{' => {
                    self.stack.push(true);
                    self.expect = Expect::KeyOrEnd;
                }
                b'[' => {
                    self.stack.push(false);
                    self.expect = Expect::ValueOrEnd;
                }
                b'"' => {
                    self.scalar = Scalar::String {
                        key: false,
                        escape: false,
                        hex: None,
                    };
                }
                b'-' => self.scalar = Scalar::Number { needs_digit: true },
                b'0'..=b'9' => self.scalar = Scalar::Number { needs_digit: false },
                b't' => self.scalar = Scalar::Literal("rue"),
                b'f' => self.scalar = Scalar::Literal("alse"),
                b'n' => self.scalar = Scalar::Literal("ull"),
                _ => self.fail(),
            },
            Expect::KeyOrEnd | Expect::Key => match b {
                b'}' if self.expect == Expect::KeyOrEnd => self.close(true),
                b'"' => {
                    self.scalar = Scalar::String {
                        key: true,
                        escape: false,
                        hex: None,
                    };
                }
                _ => self.fail(),
            },
            Expect::Colon => match b {
                b':' => self.expect = Expect::Value,
                _ => self.fail(),
            },
            Expect::CommaOrEnd => match (b, self.stack.last()) {
                (b',', Some(&object)) => {
                    self.expect = if object { Expect::Key } else { Expect::Value };
                }
                (b'}', Some(true)) => self.close(true),
                (b']', Some(false)) => self.close(false),
                _ => self.fail(),
            },
            Expect::Done => self.fail(),
        }
    }

    fn close(&mut self, object: bool) {
        debug_assert_eq!(self.stack.last(), Some(&object));
        self.stack.pop();
        self.expect = if self.stack.is_empty() {
            Expect::Done
        } else {
            Expect::CommaOrEnd
        };
    }

    fn fail(&mut self) {
        self.broken = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every prefix of these documents, completed by its suffix, parses as JSON; a complete
    /// document's suffix is empty.
    #[test]
    fn every_prefix_completes_to_json() {
        let documents = [
            r#"{"a": [1, -2.5e+3, true, null, {"b": "x\"\\\u00e9y"}], "c": {}}"#,
            r#"[[], [false], "s", 0.5, {"k": []}]"#,
            r#"{"deep": {"deeper": {"deepest": [1, [2, [3]]]}}}"#,
            r#""just a string""#,
        ];
        for doc in documents {
            for cut in 1..=doc.len() {
                if !doc.is_char_boundary(cut) {
                    continue;
                }
                let mut closer = JsonCloser::default();
                closer.push(&doc[..cut]);
                let suffix = closer.suffix().unwrap_or_else(|| panic!("{}", &doc[..cut]));
                let whole = format!("{}{suffix}", &doc[..cut]);
                serde_json::from_str::<serde_json::Value>(&whole)
                    .unwrap_or_else(|e| panic!("{whole}: {e}"));
                if cut == doc.len() {
                    assert_eq!(suffix, "", "{doc}");
                }
            }
        }
    }

    #[test]
    fn text_that_is_not_json_has_no_closer() {
        for text in ["{]", "[1 2", "{\"a\" 1", "nul!", "tx"] {
            let mut closer = JsonCloser::default();
            closer.push(text);
            assert_eq!(closer.suffix(), None, "{text}");
        }
        assert_eq!(JsonCloser::default().suffix(), None);
    }
}
