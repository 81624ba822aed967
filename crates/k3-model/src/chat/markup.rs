//! XTML's markup: the markers, the fixed texts the template writes, the segment writer and
//! the template's small string helpers.

use serde_json::Value;

use super::pyjson;
use super::types::Segment;

pub(super) const OPEN: &str = "<|open|>";
pub(super) const CLOSE: &str = "<|close|>";
pub(super) const SEP: &str = "<|sep|>";
/// The end-of-turn token (docs/MODEL.md §9.3), the default stop token.
pub const END_OF_MSG: &str = "<|end_of_msg|>";

const TOOLS_HEADER: &str = "# Tools\nHere are the available tools, described in JSONSchema.\n\n";
const NEW_TOOLS_HEADER: &str = "## New Tools Available\nThe system dynamically extends the \
    toolset via lazy-loading.\nYou have access to all existing and extended tools.\nHere are \
    the specs for the extended tools.\n\n";
pub(super) const JSON_RAW: &str = "Your response must be raw JSON data without markdown code blocks \
    (```json) or any additional formatting.";

/// Builds the segment list.
#[derive(Debug, Default)]
pub(super) struct Writer {
    pub(super) segments: Vec<Segment>,
}

impl Writer {
    pub(super) fn special(&mut self, text: &str) {
        self.segments.push(Segment {
            text: text.to_owned(),
            special: true,
        });
    }

    pub(super) fn text(&mut self, text: &str) {
        if !text.is_empty() {
            self.segments.push(Segment {
                text: text.to_owned(),
                special: false,
            });
        }
    }

    pub(super) fn open(&mut self, name: &str, attributes: &[(&str, &str)]) {
        self.special(OPEN);
        self.text(name);
        for (key, value) in attributes {
            self.text(&format!(" {key}"));
            self.text("=\"");
            self.text(&escape(value));
            self.text("\"");
        }
        self.special(SEP);
    }

    pub(super) fn close(&mut self, name: &str) {
        self.special(CLOSE);
        self.text(name);
        self.special(SEP);
    }

    pub(super) fn element(&mut self, name: &str, attributes: &[(&str, &str)], body: &str) {
        self.open(name, attributes);
        self.text(body);
        self.close(name);
    }

    /// A whole message with `body` (the template's `internal_system_message` and plain
    /// messages).
    pub(super) fn message(&mut self, attributes: &[(&str, &str)], body: &str) {
        self.element("message", attributes, body);
        self.special(END_OF_MSG);
    }

    pub(super) fn system(&mut self, kind: &str, body: &str) {
        self.message(&[("role", "system"), ("type", kind)], py_trim(body));
    }

    pub(super) fn tool_declaration(&mut self, tools: &Value, dynamic: bool) {
        self.message(
            &[("role", "system"), ("type", "tool-declare")],
            &tool_declaration_body(tools, dynamic),
        );
    }
}

/// Attribute escaping, as the template's `escape_attr`: `&` and `"` only.
pub fn escape(value: &str) -> String {
    value.replace('&', "&amp;").replace('"', "&quot;")
}

/// The body of the tool-declaration message for `tools` (a JSON array of tool schemas).
pub fn tool_declaration(tools: &Value) -> String {
    tool_declaration_body(tools, false)
}

fn tool_declaration_body(tools: &Value, dynamic: bool) -> String {
    let header = if dynamic {
        NEW_TOOLS_HEADER
    } else {
        TOOLS_HEADER
    };
    format!("{header}```json\n{}\n```", pyjson::sorted(tools))
}

/// Jinja's truthiness for a JSON value (`{% if tools %}`).
pub(super) fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Python's `str.strip()` (the template's `trim`): also strips U+001C..U+001F, which Rust's
/// `trim` keeps.
pub(super) fn py_trim(text: &str) -> &str {
    text.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
}
