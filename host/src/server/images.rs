//! A chat request's images: base64 `data:` URIs decoded (PNG, JPEG, WebP, GIF's first frame)
//! under caps checked before any pixel is decoded — the encoded size, then the dimensions the
//! header declares (a decompression bomb declares far more pixels than its bytes could hold) —
//! then the release preprocessing. Remote URLs are refused: fetching arbitrary URLs on a user's
//! behalf is a server-side request-forgery risk.

use std::io::Cursor;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits};
use serde_json::{Map, Value};

use super::openai::ApiError;
use crate::model::vision::Image;

/// The caps on one image.
#[derive(Clone, Copy, Debug)]
pub struct ImageCaps {
    /// Largest encoded image (after base64 decoding), bytes.
    pub max_bytes: usize,
    /// Most pixels (width × height) an image may declare.
    pub max_pixels: u64,
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError { code: Some("invalid_image"), ..ApiError::param("messages", msg) }
}

/// The request's image URLs in prompt order (messages in order, parts in order), as the
/// template renders their `<|media_pad|>` blocks.
pub fn image_urls(obj: &Map<String, Value>) -> Vec<Option<&str>> {
    let mut out = Vec::new();
    for m in obj.get("messages").and_then(Value::as_array).into_iter().flatten() {
        for part in m.get("content").and_then(Value::as_array).into_iter().flatten() {
            let url = match part.get("type").and_then(Value::as_str) {
                Some("image_url") => part.get("image_url").map(|u| u.get("url").unwrap_or(u)),
                Some("image") => part.get("image"),
                _ => continue,
            };
            out.push(url.and_then(Value::as_str));
        }
    }
    out
}

/// Decodes image `index` of the request (for error messages) from its data URI.
pub fn decode_data_uri(url: &str, index: usize, caps: ImageCaps) -> Result<Image, ApiError> {
    let which = format!("image {}", index + 1);
    let Some(rest) = url.strip_prefix("data:") else {
        return Err(bad(format!(
            "{which}: image URLs must be base64 `data:` URIs (this server does not fetch remote images)"
        )));
    };
    let Some((meta, payload)) = rest.split_once(',') else {
        return Err(bad(format!("{which}: malformed data URI (no `,`)")));
    };
    if !meta.ends_with(";base64") {
        return Err(bad(format!("{which}: image data URIs must be base64-encoded")));
    }
    // The decoded size is known from the text's length: refuse before decoding anything.
    let payload = payload.trim();
    if payload.len() / 4 * 3 > caps.max_bytes + 3 {
        return Err(bad(format!("{which}: the encoded image is over this server's limit of {} bytes", caps.max_bytes)));
    }
    let bytes = STANDARD
        .decode(payload.as_bytes())
        .map_err(|e| bad(format!("{which}: the data URI is not valid base64: {e}")))?;
    let reader = ImageReader::new(Cursor::new(&bytes[..]))
        .with_guessed_format()
        .map_err(|e| bad(format!("{which}: unreadable image: {e}")))?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif) => {}
        _ => return Err(bad(format!("{which}: not a PNG, JPEG, WebP or GIF image"))),
    }
    let mut limits = Limits::default();
    // Decoders refuse allocations past this (RGBA8 of the largest allowed image, plus slack).
    limits.max_alloc = Some(caps.max_pixels.saturating_mul(8).saturating_add(1 << 20));
    let mut reader = reader;
    reader.limits(limits);
    let decoder = reader.into_decoder().map_err(|e| bad(format!("{which}: unreadable image: {e}")))?;
    let (w, h) = decoder.dimensions();
    if w == 0 || h == 0 {
        return Err(bad(format!("{which}: the image is empty ({w}x{h})")));
    }
    if u64::from(w) * u64::from(h) > caps.max_pixels {
        return Err(bad(format!(
            "{which}: {w}x{h} is {} pixels, over this server's limit of {}",
            u64::from(w) * u64::from(h),
            caps.max_pixels
        )));
    }
    let img = DynamicImage::from_decoder(decoder).map_err(|e| bad(format!("{which}: cannot decode the image: {e}")))?;
    let (w, h) = (img.width() as usize, img.height() as usize);
    // Transparent images keep alpha (composited after the resize, as the release does).
    Ok(if img.color().has_alpha() {
        Image::rgba(w, h, img.into_rgba8().into_raw())
    } else {
        Image::rgb(w, h, img.into_rgb8().into_raw())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> ImageCaps {
        ImageCaps { max_bytes: 1 << 20, max_pixels: 1 << 20 }
    }

    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, ImageFormat::Png).expect("encode");
        out.into_inner()
    }

    fn uri(bytes: &[u8]) -> String {
        format!("data:image/png;base64,{}", STANDARD.encode(bytes))
    }

    #[test]
    fn a_png_decodes_to_its_pixels() {
        let img = decode_data_uri(&uri(&png(5, 3)), 0, caps()).expect("decodes");
        assert_eq!((img.width, img.height, img.channels), (5, 3, 3));
        assert_eq!(&img.data[3 * 4..3 * 5], &[4, 0, 7]);
    }

    #[test]
    fn bad_images_are_named_errors() {
        let mut truncated = png(40, 40);
        truncated.truncate(truncated.len() / 2);
        for (what, url) in [
            ("remote", "https://example.com/a.png".to_string()),
            ("not base64", "data:image/png;base64,@@@".to_string()),
            ("not an image", uri(b"hello, world")),
            ("truncated", uri(&truncated)),
        ] {
            assert!(decode_data_uri(&url, 0, caps()).is_err(), "{what} was accepted");
        }
        // Declared size over the cap: refused from the header.
        let big = png(2048, 1024);
        let e = decode_data_uri(&uri(&big), 0, caps()).expect_err("refused");
        assert!(e.message.contains("pixels"), "{}", e.message);
    }
}
