//! The guardian's wire format: frames `[u32 length][u8 tag][body]`, integers little-endian,
//! strings `[u32 length][bytes]` (the tags are listed in `mod.rs`). Touches no Redis keys.

use super::MAX_FRAME;

pub(super) struct Frame(Vec<u8>);

impl Frame {
    pub(super) fn new(tag: u8) -> Frame {
        Frame(vec![0, 0, 0, 0, tag])
    }
    /// A frame whose body will be about `size` bytes (one allocation instead of regrowth).
    pub(super) fn with_capacity(tag: u8, size: usize) -> Frame {
        let mut v = Vec::with_capacity(size + 5);
        v.extend_from_slice(&[0, 0, 0, 0, tag]);
        Frame(v)
    }
    pub(super) fn u64(mut self, v: u64) -> Frame {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn i32(mut self, v: i32) -> Frame {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn bytes(mut self, b: &[u8]) -> Frame {
        self.0.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    pub(super) fn done(mut self) -> Vec<u8> {
        let len = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&len.to_le_bytes());
        self.0
    }
}

/// Reads one frame's body.
pub(super) struct Body<'a>(pub(super) &'a [u8]);

impl<'a> Body<'a> {
    pub(super) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    pub(super) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    pub(super) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    pub(super) fn i32(&mut self) -> Option<i32> {
        Some(i32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    pub(super) fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
}

/// Split complete frames off the front of `buf`: (tag, body) each.
pub(super) fn frames(buf: &mut Vec<u8>, mut each: impl FnMut(u8, Body<'_>)) -> Result<(), ()> {
    let mut at = 0;
    while buf.len() - at >= 4 {
        let len = u32::from_le_bytes(buf[at..at + 4].try_into().unwrap()) as usize;
        if len == 0 || len > MAX_FRAME {
            return Err(());
        }
        if buf.len() - at - 4 < len {
            break;
        }
        let f = &buf[at + 4..at + 4 + len];
        each(f[0], Body(&f[1..]));
        at += 4 + len;
    }
    buf.drain(..at);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn frames_split_whole_frames_and_keep_the_rest() {
        let a = Frame::new(b'K').u64(7).u64(12).done();
        let b = Frame::new(b'e').u64(8).i32(2).bytes(b"no such file").done();
        let mut buf = [a.clone(), b.clone()].concat();
        buf.extend_from_slice(&a[..5]);
        let mut got = Vec::new();
        frames(&mut buf, |tag, mut body| {
            got.push((tag, body.u64(), body.0.to_vec()));
        })
        .unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].0, got[0].1), (b'K', Some(7)));
        let mut rest = Body(&got[1].2);
        assert_eq!(rest.i32(), Some(2));
        assert_eq!(rest.bytes(), Some(&b"no such file"[..]));
        assert_eq!(buf, a[..5].to_vec(), "a partial frame waits for the rest");
        assert!(frames(&mut vec![0, 0, 0, 0], |_, _| {}).is_err());
    }
}
