//! What was wrong with a request head hyper's HTTP/1.1 parser refused, told from the bytes it
//! had read: the error object answered in place of hyper's bare 400, 414 or 431. The checks
//! follow hyper's (`proto/h1/role.rs`), so a head hyper accepted is never found wrong here.

use axum::http::{Method, StatusCode, Uri};

use crate::api::error::ApiError;

/// Header fields in a request head, at most (431 above): hyper's default, set explicitly so
/// that the message can name it.
pub(super) const MAX_HEADER_FIELDS: usize = 100;

/// Bytes of a request head hyper buffers while waiting for its end (431 above, or 414 when
/// the request line alone does not fit). A head that arrives in one piece may be parsed from
/// a little more; below this, none is refused for its size.
pub(super) const MAX_HEAD_BYTES: usize = 64 << 10;

/// hyper's limit on a request target, checked once the whole head is in.
const MAX_TARGET_BYTES: usize = u16::MAX as usize - 1;

/// The largest Content-Length hyper takes (`DecodedLength::MAX_LEN`).
const MAX_CONTENT_LENGTH: u64 = u64::MAX - 2;

/// What hyper had read of a connection when it refused a head.
#[derive(Debug, Clone, Copy)]
pub(super) struct Read<'a> {
    /// What hyper had not consumed: the refused head itself, unless hyper took the head off
    /// its buffer before checking what its fields mean (the target, Content-Length,
    /// Transfer-Encoding), and then the head ends `before`.
    pub(super) rest: &'a [u8],
    /// The bytes read just before `rest`, as many as were kept; `None` if not known.
    pub(super) before: Option<&'a [u8]>,
    /// Whether `before` starts at the connection's first byte.
    pub(super) from_start: bool,
}

/// The error for a head hyper refused with `status` (400, 414 or 431): what was wrong with
/// it, else hyper's own words.
pub(super) fn refused_head(
    status: StatusCode,
    read: Read<'_>,
    hyper_says: &dyn std::fmt::Display,
) -> ApiError {
    let unparsed = || format!("the request head could not be parsed: {hyper_says}");
    let taken = taken_head(read);
    if let Taken::Head(head) = taken
        && let Some(problem) = meaning(head)
    {
        // A 400 whatever hyper's status: it answers 431 for a Content-Length past its
        // largest, which is a bad value, not a large head.
        return ApiError::new(StatusCode::BAD_REQUEST, problem);
    }
    let (request_line, fields) = split_line(read.rest);
    let message = match (status, fields) {
        // The buffer filled before the request line ended: that line is what is too long.
        (StatusCode::URI_TOO_LONG | StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, None) => {
            return ApiError::new(
                StatusCode::URI_TOO_LONG,
                format!(
                    "the request line is longer than {MAX_HEAD_BYTES} bytes, the limit for a whole request head"
                ),
            );
        }
        (StatusCode::URI_TOO_LONG, Some(_)) => {
            let target = request_line
                .split(|&b| b == b' ')
                .nth(1)
                .unwrap_or_default();
            format!(
                "the request line is too long: its target has {} bytes, over the limit of {MAX_TARGET_BYTES}",
                target.len()
            )
        }
        (StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, Some(fields)) => {
            let n_fields = fields
                .split(|&b| b == b'\n')
                .take_while(|field| !trim_cr(field).is_empty())
                .count();
            if n_fields > MAX_HEADER_FIELDS {
                format!(
                    "the request head has more than the limit of {MAX_HEADER_FIELDS} header fields"
                )
            } else {
                format!("the request head exceeds the limit of {MAX_HEAD_BYTES} bytes")
            }
        }
        // A head may have been taken off, and then what is left is not the head.
        _ if matches!(taken, Taken::Unknown) => unparsed(),
        _ => syntax(read.rest).unwrap_or_else(unparsed),
    };
    ApiError::new(status, message)
}

/// The head hyper took off its buffer just before `rest`, as far as `before` tells.
#[derive(Debug, Clone, Copy)]
enum Taken<'a> {
    /// `before` does not end with a head.
    Nothing,
    Head(&'a [u8]),
    /// `before` is not known, or ends with a head's end but not all of the head was kept.
    Unknown,
}

/// A head ends with an empty line and begins with a request line, with field lines between;
/// a head hyper took off its buffer passed its parser, so no field line looks like a request
/// line and the nearest request line back from the end is the head's.
fn taken_head(read: Read<'_>) -> Taken<'_> {
    let Some(before) = read.before else {
        return Taken::Unknown;
    };
    let Some(lines) = before
        .strip_suffix(b"\n\r\n")
        .or_else(|| before.strip_suffix(b"\n\n"))
    else {
        return Taken::Nothing;
    };
    let mut end = lines.len();
    loop {
        let start = lines[..end]
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |newline| newline + 1);
        let line = trim_cr(&lines[start..end]);
        // The first line kept is whole only if it is the connection's first.
        let whole = start > 0 || read.from_start;
        if whole && request_line(line).is_some() {
            return Taken::Head(&before[start..]);
        }
        if start == 0 || !is_field_line(line) {
            return Taken::Unknown;
        }
        end = start - 1;
    }
}

/// What a head that passed hyper's parser means that hyper refuses, if anything.
fn meaning(head: &[u8]) -> Option<String> {
    let (line, fields) = split_line(head);
    let (method, target, version) = request_line(line)?;
    if Method::from_bytes(method).is_err() {
        return Some(format!("invalid HTTP method {}", shown(method)));
    }
    if let Err(e) = Uri::try_from(target) {
        return Some(format!(
            "the request target {} is not a URI: {e}",
            shown(target)
        ));
    }
    let mut length: Option<u64> = None;
    let mut transfer_encoding: Option<&[u8]> = None;
    for field in fields
        .unwrap_or_default()
        .split(|&b| b == b'\n')
        .map(trim_cr)
    {
        let Some(colon) = field.iter().position(|&b| b == b':') else {
            break;
        };
        let (name, value) = (&field[..colon], field[colon + 1..].trim_ascii());
        if name.eq_ignore_ascii_case(b"transfer-encoding") {
            if version != b"HTTP/1.1" {
                return Some(format!(
                    "a Transfer-Encoding header in an {} request: only HTTP/1.1 has one",
                    String::from_utf8_lossy(version)
                ));
            }
            // A Content-Length before it is dropped; one after it is not even read.
            transfer_encoding = Some(value);
            length = None;
        } else if name.eq_ignore_ascii_case(b"content-length") && transfer_encoding.is_none() {
            let parsed = std::str::from_utf8(value)
                .ok()
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|&n| n <= MAX_CONTENT_LENGTH);
            match (parsed, length) {
                (None, _) => {
                    return Some(format!(
                        "invalid Content-Length {}: it must be a number of bytes, at most {MAX_CONTENT_LENGTH}",
                        shown(value)
                    ));
                }
                (Some(n), Some(before)) if n != before => {
                    return Some(format!(
                        "two Content-Length headers with different values, {before} and {n}"
                    ));
                }
                (Some(n), _) => length = Some(n),
            }
        }
    }
    if let Some(codings) = transfer_encoding {
        let last = codings.rsplit(|&b| b == b',').next().unwrap_or_default();
        if !last.trim_ascii().eq_ignore_ascii_case(b"chunked") {
            return Some(format!(
                "Transfer-Encoding {} does not end with chunked, so the body has no length",
                shown(codings)
            ));
        }
    }
    None
}

/// What in `rest`, a head that failed hyper's parser, breaks the syntax of a head, if this
/// can tell.
fn syntax(rest: &[u8]) -> Option<String> {
    if rest.starts_with(&[0x16, 0x03]) {
        return Some(
            "this port speaks plain HTTP, and the request is a TLS handshake: use http://, not https://"
                .into(),
        );
    }
    let (line, fields) = split_line(rest);
    let mut parts = line.split(|&b| b == b' ');
    let method = parts.next().unwrap_or_default();
    if method.is_empty() || !method.iter().all(|&b| is_token(b)) {
        return Some(format!(
            "the request does not start with an HTTP method: {}",
            shown(line)
        ));
    }
    // Unless the request line has ended, what is wrong may still be to come.
    let fields = fields?;
    match (parts.next(), parts.next(), parts.next()) {
        (Some(_), None, _) => {
            return Some(format!(
                "the request line {} has no HTTP version: HTTP/0.9 is not served, send HTTP/1.1",
                shown(line)
            ));
        }
        (Some(_), Some(version), None) if version != b"HTTP/1.1" && version != b"HTTP/1.0" => {
            return Some(format!(
                "unsupported HTTP version {} in the request line, which says HTTP/1.0 or HTTP/1.1 (HTTP/2 is served with prior knowledge: frames after its connection preface)",
                shown(version)
            ));
        }
        (Some(target), Some(_), None) => {
            if let Some(&bad) = target.iter().find(|&&b| b <= b' ' || b == 0x7f) {
                return Some(format!(
                    "the request target {} has an invalid byte 0x{bad:02x}",
                    shown(target)
                ));
            }
        }
        _ => {
            return Some(format!(
                "the request line {} is not `METHOD target HTTP/1.1`",
                shown(line)
            ));
        }
    }
    for field in fields.split(|&b| b == b'\n').map(trim_cr) {
        if field.is_empty() {
            break;
        }
        let (name, value) = match field.iter().position(|&b| b == b':') {
            Some(colon) => (&field[..colon], &field[colon + 1..]),
            None => (field, &[][..]),
        };
        if let Some(&bad) = name.iter().find(|&&b| !is_token(b)) {
            return Some(format!(
                "a header field name has an invalid byte 0x{bad:02x}: {}",
                shown(name)
            ));
        }
        if let Some(&bad) = value
            .iter()
            .find(|&&b| (b < b' ' && b != b'\t') || b == 0x7f)
        {
            return Some(format!(
                "the header field {} has an invalid byte 0x{bad:02x} in its value",
                shown(name)
            ));
        }
    }
    None
}

/// `METHOD target HTTP/1.x`: its three parts.
fn request_line(line: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let mut parts = line.split(|&b| b == b' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    let valid = parts.next().is_none()
        && !method.is_empty()
        && method.iter().all(|&b| is_token(b))
        && !target.is_empty()
        && (version == b"HTTP/1.1" || version == b"HTTP/1.0");
    valid.then_some((method, target, version))
}

/// The first line of `head` (without its CR) and what follows it, if it has ended.
fn split_line(head: &[u8]) -> (&[u8], Option<&[u8]>) {
    match head.iter().position(|&b| b == b'\n') {
        Some(end) => (trim_cr(&head[..end]), Some(&head[end + 1..])),
        None => (head, None),
    }
}

fn trim_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// `name: value`, as far as the name.
fn is_field_line(line: &[u8]) -> bool {
    line.iter()
        .position(|&b| b == b':')
        .is_some_and(|colon| colon > 0 && line[..colon].iter().all(|&b| is_token(b)))
}

/// RFC 9110's `tchar`: the bytes of a method or a header field name.
fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Some client bytes for a message: quoted, escaped, at most 64 of them.
fn shown(bytes: &[u8]) -> String {
    const SHOWN: usize = 64;
    let more = if bytes.len() > SHOWN { "..." } else { "" };
    format!(
        "\"{}{more}\"",
        bytes[..bytes.len().min(SHOWN)].escape_ascii()
    )
}

#[cfg(test)]
mod tests;
