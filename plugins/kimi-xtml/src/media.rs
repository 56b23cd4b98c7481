//! Image parts: the original width × height of a `data:` URI image, which the media block's
//! text carries (spec k3-serving §4.2). Only the header is read; pixels are the vision tower's
//! business. Remote URLs are refused: a sandboxed template has no network, and fetching
//! arbitrary URLs on a user's behalf is a server-side request-forgery risk.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;

use crate::RenderError;

fn bad<T>(msg: impl Into<String>) -> Result<T, RenderError> {
    Err(RenderError(msg.into()))
}

/// (width, height) of a base64 `data:image/…` URI holding a PNG, JPEG, GIF or WebP image.
pub fn data_uri_image_size(url: &str) -> Result<(u32, u32), RenderError> {
    let Some(rest) = url.strip_prefix("data:") else {
        return bad("image URLs must be base64 `data:` URIs (this server does not fetch remote images)");
    };
    let Some((meta, payload)) = rest.split_once(',') else { return bad("malformed data URI: no `,`") };
    if !meta.ends_with(";base64") {
        return bad("image data URIs must be base64-encoded");
    }
    let bytes = STANDARD
        .decode(payload.trim().as_bytes())
        .map_err(|e| RenderError(format!("image data URI is not valid base64: {e}")))?;
    let (w, h) =
        image_size(&bytes).ok_or_else(|| RenderError("image is not a readable PNG, JPEG, GIF or WebP".into()))?;
    if w == 0 || h == 0 {
        return bad(format!("image has an empty size {w}x{h}"));
    }
    Ok((w, h))
}

fn be16(b: &[u8], i: usize) -> Option<u32> {
    Some(u32::from(u16::from_be_bytes([*b.get(i)?, *b.get(i + 1)?])))
}

fn le16(b: &[u8], i: usize) -> Option<u32> {
    Some(u32::from(u16::from_le_bytes([*b.get(i)?, *b.get(i + 1)?])))
}

fn le24(b: &[u8], i: usize) -> Option<u32> {
    Some(u32::from_le_bytes([*b.get(i)?, *b.get(i + 1)?, *b.get(i + 2)?, 0]))
}

fn image_size(b: &[u8]) -> Option<(u32, u32)> {
    if b.starts_with(b"\x89PNG\r\n\x1a\n") && b.get(12..16) == Some(b"IHDR") {
        let w = u32::from_be_bytes(b.get(16..20)?.try_into().ok()?);
        let h = u32::from_be_bytes(b.get(20..24)?.try_into().ok()?);
        return Some((w, h));
    }
    if b.starts_with(b"GIF87a") || b.starts_with(b"GIF89a") {
        return Some((le16(b, 6)?, le16(b, 8)?));
    }
    if b.starts_with(b"\xff\xd8") {
        return jpeg_size(b);
    }
    if b.get(0..4) == Some(b"RIFF") && b.get(8..12) == Some(b"WEBP") {
        return match b.get(12..16)? {
            b"VP8 " => Some((le16(b, 26)? & 0x3fff, le16(b, 28)? & 0x3fff)),
            b"VP8L" => {
                let v = u32::from_le_bytes(b.get(21..25)?.try_into().ok()?);
                Some(((v & 0x3fff) + 1, ((v >> 14) & 0x3fff) + 1))
            }
            b"VP8X" => Some((le24(b, 24)? + 1, le24(b, 27)? + 1)),
            _ => None,
        };
    }
    None
}

/// Walks JPEG markers to the first start-of-frame.
fn jpeg_size(b: &[u8]) -> Option<(u32, u32)> {
    let mut i = 2;
    loop {
        while *b.get(i)? != 0xff {
            i += 1;
        }
        while *b.get(i)? == 0xff {
            i += 1;
        }
        let marker = *b.get(i)?;
        i += 1;
        match marker {
            0xd8 | 0x01 | 0xd0..=0xd7 => continue,
            0xd9 | 0xda => return None,
            0xc0..=0xcf if !matches!(marker, 0xc4 | 0xc8 | 0xcc) => {
                return Some((be16(b, i + 5)?, be16(b, i + 3)?));
            }
            _ => i += usize::try_from(be16(b, i)?).ok()?,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uri(bytes: &[u8]) -> String {
        format!("data:image/png;base64,{}", STANDARD.encode(bytes))
    }

    #[test]
    fn png_gif_jpeg_webp_headers() {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        png.extend_from_slice(&1024u32.to_be_bytes());
        png.extend_from_slice(&768u32.to_be_bytes());
        assert_eq!(data_uri_image_size(&uri(&png)), Ok((1024, 768)));
        let gif = b"GIF89a\x00\x02\x00\x01";
        assert_eq!(data_uri_image_size(&uri(gif)), Ok((512, 256)));
        // SOI, an APP0 segment of length 4, then SOF0 (len, precision, height 300, width 400).
        let jpeg = b"\xff\xd8\xff\xe0\x00\x04\x00\x00\xff\xc0\x00\x11\x08\x01\x2c\x01\x90";
        assert_eq!(data_uri_image_size(&uri(jpeg)), Ok((400, 300)));
        let mut webp = b"RIFF\0\0\0\0WEBPVP8X\0\0\0\0\0\0\0\0".to_vec();
        webp.extend_from_slice(&[0xff, 0x00, 0x00, 0x7f, 0x00, 0x00]);
        assert_eq!(data_uri_image_size(&uri(&webp)), Ok((256, 128)));
    }

    #[test]
    fn bad_images_are_named_errors() {
        assert!(data_uri_image_size("https://example.com/a.png").is_err());
        assert!(data_uri_image_size("data:image/png;base64,@@@").is_err());
        assert!(data_uri_image_size(&uri(b"not an image")).is_err());
        assert!(data_uri_image_size(&uri(b"\xff\xd8\xff")).is_err());
    }
}
