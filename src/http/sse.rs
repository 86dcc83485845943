//! Server-sent events from an upstream, read incrementally: bytes in, each event's `data` out.
//! Lines end in `\n` or `\r\n`; `data:` lines of one event are joined with `\n`; comments and
//! other fields are skipped. A line longer than `MAX_LINE` is an error, not a growing buffer.

/// The longest line accepted (an upstream that never ends a line is broken, not patient).
pub(crate) const MAX_LINE: usize = 1 << 20;

#[derive(Default)]
pub struct Parser {
    buf: Vec<u8>,
    data: Option<String>,
}

#[derive(Debug, PartialEq, Eq)]
pub struct LineTooLong;

impl Parser {
    /// Feed the next bytes; the data of every event they complete, in order.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<String>, LineTooLong> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        let mut start = 0;
        while let Some(n) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let mut line = &self.buf[start..start + n];
            start += n + 1;
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            if line.is_empty() {
                events.extend(self.data.take());
            } else if let Some(value) = line.strip_prefix(b"data:") {
                let value = value.strip_prefix(b" ").unwrap_or(value);
                let value = String::from_utf8_lossy(value);
                match &mut self.data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(&value);
                    }
                    None => self.data = Some(value.into_owned()),
                }
            }
        }
        self.buf.drain(..start);
        if self.buf.len() > MAX_LINE {
            return Err(LineTooLong);
        }
        Ok(events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_come_out_whole_however_the_bytes_are_split() {
        let text = "data: {\"a\":1}\n\n: a comment\r\nevent: x\r\ndata: two\r\ndata: lines\r\n\r\ndata: [DONE]\n\n";
        let want = vec!["{\"a\":1}", "two\nlines", "[DONE]"];
        for split in 1..text.len() {
            let mut p = Parser::default();
            let (a, b) = text.as_bytes().split_at(split);
            let mut got = p.feed(a).unwrap();
            got.extend(p.feed(b).unwrap());
            assert_eq!(got, want, "split at {split}");
        }
    }

    #[test]
    fn an_event_without_its_blank_line_is_not_out_yet() {
        let mut p = Parser::default();
        assert!(p.feed(b"data: half\n").unwrap().is_empty());
        assert_eq!(p.feed(b"\n").unwrap(), ["half"]);
    }

    #[test]
    fn a_line_that_never_ends_is_an_error() {
        let mut p = Parser::default();
        let chunk = vec![b'x'; 64 * 1024];
        let mut result = Ok(vec![]);
        for _ in 0..20 {
            result = p.feed(&chunk);
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(LineTooLong));
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_parse_or_fail_without_panicking(chunks in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64), 0..16)) {
            let mut p = Parser::default();
            for c in chunks {
                let _ = p.feed(&c);
            }
        }
    }
}
