//! A streaming chat client on a plain `TcpStream`: one request per connection, the chunked SSE
//! body decoded as it arrives, and the instant each chunk of generated text was read.
//!
//! Both servers stream one token per chunk, so those instants are the tokens' arrival times as
//! a user sees them, after each server's own buffering. No HTTP library: the two servers'
//! answers need only a status line, `Transfer-Encoding: chunked` and `data:` lines.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k3_model::tokenizer::Tokenizer;

/// A server that sends nothing for this long (not even a keep-alive) fails the run: a long
/// prefill of the real model on few threads takes minutes, not this.
const READ_TIMEOUT: Duration = Duration::from_secs(900);

/// One streamed request as the client saw it.
#[derive(Debug, Clone)]
pub(super) struct Trace {
    /// When the request was written.
    pub(super) sent: Instant,
    /// When each chunk carrying generated text (content or reasoning) was read.
    pub(super) tokens: Vec<Instant>,
    /// When the chunk with the `finish_reason` was read.
    pub(super) finished: Option<Instant>,
    /// The server's `usage`: prompt and completion tokens.
    pub(super) usage: Option<(u64, u64)>,
}

impl Trace {
    /// When the first token was read: its text, or the end of a stream whose first tokens
    /// had none (a random-weight model's token can be a lone byte of a UTF-8 character).
    pub(super) fn first_token(&self) -> Option<Instant> {
        self.tokens.first().copied().or(self.finished)
    }

    /// Time to the first token.
    pub(super) fn ttft(&self) -> Option<Duration> {
        Some(self.first_token()? - self.sent)
    }

    /// The gaps between successive tokens, each with the instant it ended.
    pub(super) fn gaps(&self) -> impl Iterator<Item = (Duration, Instant)> + '_ {
        self.tokens.windows(2).map(|w| (w[1] - w[0], w[1]))
    }

    /// Tokens generated: the usage's count, else the text chunks.
    pub(super) fn generated(&self) -> u64 {
        self.usage.map_or(self.tokens.len() as u64, |u| u.1)
    }
}

/// What a request's thread shares with the thread that coordinates a measurement.
#[derive(Debug, Default)]
pub(super) struct Progress {
    /// Tokens read so far.
    pub(super) tokens: AtomicUsize,
    /// The request has ended (answered, stopped or failed).
    pub(super) done: AtomicBool,
    /// Set by the coordinator: drop the connection at the next chunk, which cancels the
    /// request on both servers.
    pub(super) stop: AtomicBool,
}

impl Progress {
    /// Tokens read so far, or `usize::MAX` once the request ended (nothing more will come).
    pub(super) fn tokens_or_end(&self) -> usize {
        match self.done.load(Ordering::Acquire) {
            true => usize::MAX,
            false => self.tokens.load(Ordering::Acquire),
        }
    }
}

/// Sends one streaming chat request (`temperature` 0, `max_tokens`, the usage asked for) and
/// reads the answer to `data: [DONE]`, or until `progress.stop` is set.
pub(super) fn stream_chat(
    addr: SocketAddr,
    prompt: &str,
    max_tokens: usize,
    progress: &Progress,
) -> Result<Trace> {
    let result = stream_chat_inner(addr, prompt, max_tokens, progress);
    progress.done.store(true, Ordering::Release);
    result
}

/// `--token-ids`: every request goes to `/v1/completions` with its prompt as the token ids
/// this tokenizer encodes its text to, so both servers prefill the same tokens whatever their
/// own tokenizers make of the text (set once, before any request).
pub(super) static TOKEN_IDS: OnceLock<Tokenizer> = OnceLock::new();

fn stream_chat_inner(
    addr: SocketAddr,
    prompt: &str,
    max_tokens: usize,
    progress: &Progress,
) -> Result<Trace> {
    let mut body = serde_json::json!({
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let path = match TOKEN_IDS.get() {
        Some(tokenizer) => {
            body["prompt"] = serde_json::json!(tokenizer.encode(prompt, false));
            // The completions API's logprobs: the chosen token's, no alternatives.
            body["logprobs"] = 0.into();
            "/v1/completions"
        }
        None => {
            body["messages"] = serde_json::json!([{"role": "user", "content": prompt}]);
            // A log-probability with every token: a random checkpoint's tokens are often text
            // a server holds back (a tool call's markup, bytes of an unfinished character),
            // and the chunk that carries a token's logprob marks its arrival either way.
            body["logprobs"] = true.into();
            "/v1/chat/completions"
        }
    };
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Accept: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    let sent = Instant::now();
    stream.write_all(request.as_bytes())?;
    let mut trace = Trace {
        sent,
        tokens: Vec::new(),
        finished: None,
        usage: None,
    };
    let mut head = Vec::new();
    let mut decoder: Option<SseDecoder> = None;
    let mut error_body = None;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = stream
            .read(&mut buf)
            .with_context(|| format!("reading the answer from {addr}"))?;
        let now = Instant::now();
        if n == 0 {
            break;
        }
        let mut bytes = &buf[..n];
        let decoder = match &mut decoder {
            Some(decoder) => decoder,
            None => {
                head.extend_from_slice(bytes);
                let Some(end) = find(&head, b"\r\n\r\n") else {
                    continue;
                };
                let (status, chunked) = parse_head(&String::from_utf8_lossy(&head[..end]))?;
                if status != 200 {
                    error_body = Some((status, chunked, head[end + 4..].to_vec()));
                    break;
                }
                bytes = &head[end + 4..];
                decoder.insert(SseDecoder::new(chunked))
            }
        };
        for data in decoder.feed(bytes)? {
            let event = Event::parse(&data)?;
            if event.text {
                trace.tokens.push(now);
                progress.tokens.fetch_add(1, Ordering::AcqRel);
            }
            if event.finish {
                trace.finished = Some(now);
            }
            trace.usage = event.usage.or(trace.usage);
            if event.done {
                return Ok(trace);
            }
        }
        if progress.stop.load(Ordering::Acquire) {
            return Ok(trace);
        }
    }
    if let Some((status, chunked, mut body)) = error_body {
        // The error body is small: read it to the end (the server closes the connection).
        let _ = stream.read_to_end(&mut body);
        if chunked {
            let mut plain = Vec::new();
            Dechunker::default().feed(&body, &mut plain)?;
            body = plain;
        }
        bail!(
            "{addr} answered {status}: {}",
            String::from_utf8_lossy(&body).trim()
        );
    }
    ensure!(
        decoder.is_some(),
        "{addr} closed the connection without an answer"
    );
    // No `[DONE]`: a stream cut short by the server.
    bail!(
        "{addr} closed the stream after {} tokens without data: [DONE]",
        trace.tokens.len()
    )
}

/// The status of `GET path`, or an error if the server does not answer within a second.
pub(super) fn get_status(addr: SocketAddr, path: &str) -> Result<u16> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(1)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while find(&head, b"\r\n").is_none() {
        let n = stream.read(&mut buf)?;
        ensure!(n > 0, "{addr} closed the connection");
        head.extend_from_slice(&buf[..n]);
    }
    Ok(parse_head(&String::from_utf8_lossy(&head))?.0)
}

/// The status code of a response head, and whether its body is chunked.
fn parse_head(head: &str) -> Result<(u16, bool)> {
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("not an HTTP status line: {status_line:?}"))?;
    let chunked = lines.any(|l| {
        let (name, value) = l.split_once(':').unwrap_or_default();
        name.trim().eq_ignore_ascii_case("transfer-encoding")
            && value.to_ascii_lowercase().contains("chunked")
    });
    Ok((status, chunked))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The decoder of a streamed answer's body: the transfer framing, then SSE `data:` lines.
/// Bytes may arrive split anywhere.
#[derive(Debug)]
struct SseDecoder {
    chunks: Option<Dechunker>,
    /// Body bytes after the last complete line.
    line: Vec<u8>,
}

impl SseDecoder {
    fn new(chunked: bool) -> Self {
        Self {
            chunks: chunked.then(Dechunker::default),
            line: Vec::new(),
        }
    }

    /// Feeds the next body bytes; returns the `data:` payloads of the lines they complete.
    fn feed(&mut self, bytes: &[u8]) -> Result<Vec<String>> {
        match &mut self.chunks {
            Some(chunks) => chunks.feed(bytes, &mut self.line)?,
            None => self.line.extend_from_slice(bytes),
        }
        let mut data = Vec::new();
        let mut start = 0;
        while let Some(end) = self.line[start..].iter().position(|&b| b == b'\n') {
            let line = &self.line[start..start + end];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if let Some(payload) = line.strip_prefix(b"data:") {
                let payload = payload.strip_prefix(b" ").unwrap_or(payload);
                data.push(String::from_utf8(payload.to_vec()).context("an SSE line is not UTF-8")?);
            }
            start += end + 1;
        }
        self.line.drain(..start);
        Ok(data)
    }
}

/// Where a chunked body's decoder stands.
#[derive(Debug, Clone, Copy, Default)]
enum Part {
    /// In a chunk-size line.
    #[default]
    Size,
    /// In a chunk's data, this many bytes left.
    Data(usize),
    /// After a chunk's data, before its CRLF.
    DataEnd,
    /// Past the last (empty) chunk.
    Done,
}

/// `Transfer-Encoding: chunked`, decoded incrementally.
#[derive(Debug, Default)]
struct Dechunker {
    part: Part,
    /// Input not yet consumed (a partial size line or CRLF).
    pending: Vec<u8>,
}

impl Dechunker {
    fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<()> {
        self.pending.extend_from_slice(input);
        let mut at = 0;
        loop {
            let rest = &self.pending[at..];
            match self.part {
                Part::Size => {
                    let Some(end) = find(rest, b"\r\n") else {
                        break;
                    };
                    let line = String::from_utf8_lossy(&rest[..end]);
                    let hex = line.split(';').next().unwrap_or_default().trim();
                    let size = usize::from_str_radix(hex, 16)
                        .with_context(|| format!("bad chunk size line {line:?}"))?;
                    at += end + 2;
                    self.part = if size == 0 {
                        Part::Done
                    } else {
                        Part::Data(size)
                    };
                }
                Part::Data(left) => {
                    if rest.is_empty() {
                        break;
                    }
                    let take = left.min(rest.len());
                    out.extend_from_slice(&rest[..take]);
                    at += take;
                    self.part = if take == left {
                        Part::DataEnd
                    } else {
                        Part::Data(left - take)
                    };
                }
                Part::DataEnd => {
                    if rest.len() < 2 {
                        break;
                    }
                    ensure!(rest.starts_with(b"\r\n"), "a chunk does not end in CRLF");
                    at += 2;
                    self.part = Part::Size;
                }
                Part::Done => break,
            }
        }
        self.pending.drain(..at);
        Ok(())
    }
}

/// What one `data:` payload says.
#[derive(Debug, Default, PartialEq)]
struct Event {
    /// It carries a generated token: a non-empty `content` or `reasoning_content` delta, or a
    /// token's log-probability (`logprobs.content`).
    text: bool,
    /// It carries a `finish_reason`.
    finish: bool,
    /// Prompt and completion tokens, from a `usage` object.
    usage: Option<(u64, u64)>,
    /// `[DONE]`: the stream's end.
    done: bool,
}

impl Event {
    fn parse(data: &str) -> Result<Self> {
        if data.trim() == "[DONE]" {
            return Ok(Self {
                done: true,
                ..Self::default()
            });
        }
        let chunk: serde_json::Value = serde_json::from_str(data)
            .with_context(|| format!("an SSE data line is not JSON: {data:?}"))?;
        if let Some(error) = chunk.get("error") {
            bail!("the stream carried an error: {error}");
        }
        let choice = &chunk["choices"][0];
        let delta = &choice["delta"];
        let non_empty = |key: &str| delta[key].as_str().is_some_and(|s| !s.is_empty());
        let listed = |list: &serde_json::Value| list.as_array().is_some_and(|l| !l.is_empty());
        let usage = &chunk["usage"];
        Ok(Self {
            // Chat: a delta's text or a token's logprob. Completions: every chunk before the
            // last is a token (llama-server streams one a chunk, its text empty where the
            // bytes are not a whole character yet; ours one a chunk with `logprobs`).
            text: non_empty("content")
                || non_empty("reasoning_content")
                || listed(&choice["logprobs"]["content"])
                || (choice["text"].is_string() && choice["finish_reason"].is_null()),
            finish: choice["finish_reason"].is_string(),
            usage: usage["prompt_tokens"]
                .as_u64()
                .zip(usage["completion_tokens"].as_u64()),
            done: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer as a server sends it after its head: chunks of odd sizes that split SSE lines
    /// and a multi-byte character, a keep-alive comment, CRLF line ends, the usage, `[DONE]`.
    fn captured() -> Vec<u8> {
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            ": keep-alive\n\n",
            "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"th\u{e9}\"}}]}\r\n\r\n",
            "data:{\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":2}}\n\n",
            "data: [DONE]\n\n",
        )
        .as_bytes();
        let mut body = Vec::new();
        for (i, chunk) in sse.chunks(37).enumerate() {
            // One size line with an extension, as the grammar allows.
            let ext = if i == 1 { ";name=value" } else { "" };
            body.extend_from_slice(format!("{:x}{ext}\r\n", chunk.len()).as_bytes());
            body.extend_from_slice(chunk);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(b"0\r\n\r\n");
        body
    }

    fn events(pieces: &[&[u8]]) -> Vec<Event> {
        let mut decoder = SseDecoder::new(true);
        let mut events = Vec::new();
        for piece in pieces {
            for data in decoder.feed(piece).unwrap() {
                events.push(Event::parse(&data).unwrap());
            }
        }
        events
    }

    fn expected() -> Vec<Event> {
        let text = |text| Event {
            text,
            ..Event::default()
        };
        vec![
            text(false),
            text(true),
            text(true),
            Event {
                finish: true,
                ..Event::default()
            },
            Event {
                usage: Some((12, 2)),
                ..Event::default()
            },
            Event {
                done: true,
                ..Event::default()
            },
        ]
    }

    #[test]
    fn sse_over_chunks_decodes_the_same_however_the_bytes_are_split() {
        let body = captured();
        assert_eq!(events(&[&body]), expected());
        // Every single split point, and byte by byte.
        for at in 0..=body.len() {
            assert_eq!(
                events(&[&body[..at], &body[at..]]),
                expected(),
                "split at {at}"
            );
        }
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(events(&bytes), expected());
    }

    #[test]
    fn an_unchunked_body_is_read_as_plain_lines() {
        let mut decoder = SseDecoder::new(false);
        assert!(decoder.feed(b"data: [DO").unwrap().is_empty());
        assert_eq!(decoder.feed(b"NE]\n").unwrap(), ["[DONE]"]);
    }

    /// A token whose text is held back still arrives: its chunk carries its logprob.
    #[test]
    fn a_chunk_with_a_logprob_and_no_text_is_a_token() {
        let held =
            r#"{"choices":[{"delta":{},"logprobs":{"content":[{"token":"<","logprob":-1.5}]}}]}"#;
        assert!(Event::parse(held).unwrap().text);
        let empty = r#"{"choices":[{"delta":{"content":""},"logprobs":{"content":[]}}]}"#;
        assert!(!Event::parse(empty).unwrap().text);
        // A completions chunk is a token until the one with the finish reason.
        let token = r#"{"choices":[{"text":"","logprobs":null,"finish_reason":null}]}"#;
        assert!(Event::parse(token).unwrap().text);
        let last = r#"{"choices":[{"text":"","finish_reason":"length"}]}"#;
        assert!(!Event::parse(last).unwrap().text);
    }

    #[test]
    fn a_bad_chunk_size_or_an_error_chunk_fails() {
        let mut decoder = SseDecoder::new(true);
        assert!(decoder.feed(b"zz\r\n").is_err());
        let error = Event::parse(r#"{"error":{"message":"context too long"}}"#).unwrap_err();
        assert!(error.to_string().contains("context too long"));
    }

    #[test]
    fn a_head_gives_its_status_and_framing() {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                    Transfer-Encoding: chunked\r\n";
        assert_eq!(parse_head(head).unwrap(), (200, true));
        let head = "HTTP/1.1 400 Bad Request\r\nContent-Length: 10\r\n";
        assert_eq!(parse_head(head).unwrap(), (400, false));
        assert!(parse_head("garbage").is_err());
    }
}
