//! JSON text exactly as the reference chat template writes it: Python's `json.dumps`
//! (`ensure_ascii=False`, default `", "`/`": "` separators) for argument values, and the
//! template's `json_sorted` macro (keys sorted case-insensitively, no spaces) for tool
//! declarations and response schemas.
//!
//! `serde_json` is built with `preserve_order` (workspace `Cargo.toml`), so a `Map` keeps its
//! keys in the order they arrived, as a Python `dict` does: `dumps` writes them in that order
//! and `sorted` breaks ties between keys that differ only in case by it (Python's stable
//! sort). Integers beyond 64 bits arrive as floats.

use serde_json::{Map, Number, Value};

/// `json.dumps(value, ensure_ascii=False)`.
pub(crate) fn dumps(value: &Value) -> String {
    let mut out = String::new();
    write_dumps(value, &mut out);
    out
}

/// The template's `json_sorted(value)`.
pub(crate) fn sorted(value: &Value) -> String {
    let mut out = String::new();
    write_sorted(value, &mut out);
    out
}

fn write_dumps(value: &Value, out: &mut String) {
    match value {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_dumps(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&string(key));
                out.push_str(": ");
                write_dumps(item, out);
            }
            out.push('}');
        }
        scalar => out.push_str(&scalar_text(scalar)),
    }
}

fn write_sorted(value: &Value, out: &mut String) {
    match value {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_sorted(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (key, item)) in dictsort(map).into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&string(key));
                out.push(':');
                write_sorted(item, out);
            }
            out.push('}');
        }
        scalar => out.push_str(&scalar_text(scalar)),
    }
}

/// jinja2's `dictsort`: by key, case-insensitively (Python's `str.lower`), stable.
fn dictsort(map: &Map<String, Value>) -> Vec<(&String, &Value)> {
    let mut entries: Vec<_> = map.iter().collect();
    entries.sort_by_cached_key(|(key, _)| key.to_lowercase());
    entries
}

fn scalar_text(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => number(n),
        Value::String(s) => string(s),
        Value::Array(_) | Value::Object(_) => unreachable!("scalar_text takes scalars only"),
    }
}

/// A JSON string literal. serde_json escapes exactly what Python's `json.dumps` with
/// `ensure_ascii=False` does: `"`, `\`, and the C0 controls (`\n`, `\r`, `\t`, `\b`, `\f`
/// by name, the rest as lower-case `\u00xx`).
fn string(text: &str) -> String {
    Value::String(text.to_owned()).to_string()
}

/// An integer as its digits; a float as Python's `repr`.
fn number(n: &Number) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    match n.as_f64() {
        Some(x) => float_repr(x),
        None => n.to_string(),
    }
}

/// Python's `repr(float)`: the shortest digits that round-trip (serde_json writes those too,
/// in its own layout), positional when the decimal exponent is in -4..16 (with `.0` on whole
/// numbers), else `d.ddde+XX` with at least two exponent digits.
pub(crate) fn float_repr(x: f64) -> String {
    let text = Value::from(x).to_string();
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.as_str()),
    };
    let (mantissa, exponent) = match text.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.trim_start_matches('+').parse::<i32>().unwrap_or(0)),
        None => (text, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all: String = format!("{whole}{fraction}");
    // Value = 0.ALL × 10^point.
    let mut point = whole.len() as i32 + exponent;
    let leading = all.len() - all.trim_start_matches('0').len();
    point -= leading as i32;
    let digits = all.trim_start_matches('0').trim_end_matches('0');
    let sign = if negative { "-" } else { "" };
    if digits.is_empty() {
        return format!("{sign}0.0");
    }
    // Python's exponent counts from the first digit: value = D.DDD × 10^(point - 1).
    let decimal_exponent = point - 1;
    if (-4..16).contains(&decimal_exponent) {
        let n = digits.len() as i32;
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point >= n {
            format!("{digits}{}.0", "0".repeat((point - n) as usize))
        } else {
            let (a, b) = digits.split_at(point as usize);
            format!("{a}.{b}")
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let mantissa = if rest.is_empty() {
            first.to_owned()
        } else {
            format!("{first}.{rest}")
        };
        let exp_sign = if decimal_exponent < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", decimal_exponent.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn floats_print_as_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (2.5, "2.5"),
            (-0.25, "-0.25"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e20, "1e+20"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (123.456, "123.456"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (0.1 + 0.2, "0.30000000000000004"),
        ];
        for (x, want) in cases {
            assert_eq!(float_repr(x), want, "{x:e}");
        }
    }

    #[test]
    fn dumps_and_sorted_follow_python_and_the_template() {
        // Keys in insertion order, as a Python dict keeps them (`preserve_order`).
        let v = json!({"b": [1, 2.0, null], "a": {"x": "é\n\"q\""}, "B": true});
        assert_eq!(
            dumps(&v),
            r#"{"b": [1, 2.0, null], "a": {"x": "é\n\"q\""}, "B": true}"#
        );
        // Case-insensitive, and stable: "b" came before "B".
        assert_eq!(
            sorted(&v),
            r#"{"a":{"x":"é\n\"q\""},"b":[1,2.0,null],"B":true}"#
        );
    }
}
