//! Streaming detokenizer: emits only complete UTF-8, holds back text that may still become a stop
//! string across token boundaries, and flushes what is left at the end.

use super::{Tokenizer, TokenizerError};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamOutput {
    /// Text that is now final.
    pub text: String,
    /// Index of the stop string that ended the stream (its text is not emitted).
    pub stop: Option<usize>,
}

#[derive(Clone, Debug, Default)]
pub struct StreamDecoder {
    /// Bytes of an incomplete UTF-8 sequence.
    pending: Vec<u8>,
    /// Decoded text not yet emitted because its tail may start a stop string.
    held: String,
    stops: Vec<String>,
    stopped: bool,
    skip_special: bool,
}

impl StreamDecoder {
    /// `stops`: strings that end the stream when generated (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> StreamDecoder {
        StreamDecoder { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), ..Default::default() }
    }

    /// Drop special tokens instead of emitting their names.
    pub fn skip_special(mut self, skip: bool) -> Self {
        self.skip_special = skip;
        self
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<StreamOutput, TokenizerError> {
        if self.skip_special && tok.is_special(id) {
            return Ok(StreamOutput::default());
        }
        let bytes = tok.token_bytes(id).ok_or(TokenizerError::IdOutOfRange { id, vocab: tok.vocab_size() })?;
        Ok(self.push_bytes(bytes))
    }

    pub fn push_bytes(&mut self, bytes: &[u8]) -> StreamOutput {
        if self.stopped {
            return StreamOutput::default();
        }
        self.pending.extend_from_slice(bytes);
        self.decode_pending(false);
        self.emit()
    }

    /// Ends the stream: an incomplete UTF-8 tail becomes U+FFFD, held text is released.
    pub fn finish(&mut self) -> StreamOutput {
        if self.stopped {
            return StreamOutput::default();
        }
        self.decode_pending(true);
        let out = self.emit();
        let mut text = out.text;
        if out.stop.is_none() {
            text.push_str(&std::mem::take(&mut self.held));
        }
        self.stopped = true;
        StreamOutput { text, stop: out.stop }
    }

    fn decode_pending(&mut self, last: bool) {
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    self.held.push_str(s);
                    self.pending.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: the prefix up to `valid` is valid UTF-8 by definition.
                    self.held.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            self.held.push('\u{FFFD}');
                            self.pending.drain(..valid + n);
                        }
                        None if last => {
                            self.held.push('\u{FFFD}');
                            self.pending.clear();
                            return;
                        }
                        None => {
                            self.pending.drain(..valid);
                            return;
                        }
                    }
                }
            }
        }
    }

    fn emit(&mut self) -> StreamOutput {
        // Earliest stop string wins (longest on a tie).
        let hit = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|p| (p, std::cmp::Reverse(s.len()), i)))
            .min();
        if let Some((p, _, i)) = hit {
            let text = self.held[..p].to_string();
            self.held.clear();
            self.pending.clear();
            self.stopped = true;
            return StreamOutput { text, stop: Some(i) };
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut keep = 0;
        for k in (1..longest.min(self.held.len() + 1)).rev() {
            let start = self.held.len() - k;
            if self.held.is_char_boundary(start) && self.stops.iter().any(|s| s.starts_with(&self.held[start..])) {
                keep = k;
                break;
            }
        }
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        StreamOutput { text, stop: None }
    }
}
