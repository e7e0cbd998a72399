//! Netlink messages and attributes as nf_tables speaks them: building
//! them, and reading replies. Pure: bytes in, bytes out.

// Netlink.
pub(super) const NLMSG_ERROR: u16 = 2;
pub(super) const NLMSG_DONE: u16 = 3;
pub(super) const NLM_F_REQUEST: u16 = 0x1;
pub(super) const NLM_F_ACK: u16 = 0x4;
/// A dump's message sent after a commit changed what it walks.
pub(super) const NLM_F_DUMP_INTR: u16 = 0x10;
pub(super) const NLM_F_DUMP: u16 = 0x300;
pub(super) const NLM_F_CREATE: u16 = 0x400;
pub(super) const NLA_F_NESTED: u16 = 0x8000;
pub(super) const NLM_F_APPEND: u16 = 0x800;
// nfnetlink.
pub(super) const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub(super) const NFNL_MSG_BATCH_BEGIN: u16 = 16;
pub(super) const NFNL_MSG_BATCH_END: u16 = 17;

thread_local! {
    /// The length of an attribute [`attr`] could not write since the last
    /// [`take_oversized`] on this thread.
    static OVERSIZED: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The length of an attribute too long for netlink's 16-bit length that
/// was left out since the last call (on this thread), if any: a message
/// built meanwhile must not be sent.
pub(super) fn take_oversized() -> Option<usize> {
    OVERSIZED.take()
}

/// Appends attribute `ty` with `payload`, padded to 4 bytes. An attribute
/// of 64 KiB or more cannot be said (its length is 16 bits): it is left
/// out and [`take_oversized`] tells, never written with a wrapped length
/// (the kernel would read garbage after it).
pub(super) fn attr(buf: &mut Vec<u8>, ty: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    let Ok(len16) = u16::try_from(len) else {
        OVERSIZED.set(Some(len));
        return;
    };
    buf.extend_from_slice(&len16.to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

pub(super) fn attr_str(buf: &mut Vec<u8>, ty: u16, s: &str) {
    let mut p = s.as_bytes().to_vec();
    p.push(0);
    attr(buf, ty, &p);
}

/// nf_tables numbers are big-endian.
pub(super) fn attr_u32(buf: &mut Vec<u8>, ty: u16, v: u32) {
    attr(buf, ty, &v.to_be_bytes());
}

pub(super) fn nested(buf: &mut Vec<u8>, ty: u16, inner: impl FnOnce(&mut Vec<u8>)) {
    let mut i = Vec::new();
    inner(&mut i);
    attr(buf, ty | NLA_F_NESTED, &i);
}

/// One netlink message: header, nfgenmsg, attributes.
pub(super) fn message(
    ty: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
    attrs: &[u8],
) -> Vec<u8> {
    let len = 16 + 4 + attrs.len();
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&ty.to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.push(family);
    m.push(0); // NFNETLINK_V0
    m.extend_from_slice(&res_id.to_be_bytes());
    m.extend_from_slice(attrs);
    m
}

/// Attributes of one message, as (type without flags, payload).
pub(super) fn attrs(mut b: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while b.len() >= 4 {
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let ty = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
        if len < 4 || len > b.len() {
            break;
        }
        out.push((ty, &b[4..len]));
        b = &b[len.next_multiple_of(4).min(b.len())..];
    }
    out
}

pub(super) fn get<'a>(a: &[(u16, &'a [u8])], ty: u16) -> Option<&'a [u8]> {
    a.iter().find(|(t, _)| *t == ty).map(|(_, p)| *p)
}

pub(super) fn string(p: &[u8]) -> String {
    String::from_utf8_lossy(p.split(|b| *b == 0).next().unwrap_or_default()).into_owned()
}

pub(super) fn be_u32(p: &[u8]) -> u32 {
    p.get(..4)
        .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

/// One message of a datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Message<'a> {
    pub ty: u16,
    pub flags: u16,
    pub seq: u32,
    pub payload: &'a [u8],
}

/// Each message in a datagram.
pub(super) fn messages(mut b: &[u8]) -> Vec<Message<'_>> {
    let mut out = Vec::new();
    while b.len() >= 16 {
        let len = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize;
        let ty = u16::from_ne_bytes([b[4], b[5]]);
        let flags = u16::from_ne_bytes([b[6], b[7]]);
        let seq = u32::from_ne_bytes([b[8], b[9], b[10], b[11]]);
        if len < 16 || len > b.len() {
            break;
        }
        out.push(Message {
            ty,
            flags,
            seq,
            payload: &b[16..len],
        });
        b = &b[len.next_multiple_of(4).min(b.len())..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_and_read_back() {
        let mut b = Vec::new();
        attr_str(&mut b, 2, "abc");
        attr_u32(&mut b, 5, 4);
        nested(&mut b, 1, |b| attr(b, 1, &[10, 0, 0, 1]));
        assert_eq!(b.len() % 4, 0);
        let a = attrs(&b);
        assert_eq!(string(get(&a, 2).unwrap()), "abc");
        assert_eq!(be_u32(get(&a, 5).unwrap()), 4);
        let key = attrs(get(&a, 1).unwrap());
        assert_eq!(get(&key, 1).unwrap(), [10, 0, 0, 1]);
    }

    #[test]
    fn an_attribute_past_64_kib_is_refused_not_wrapped() {
        assert_eq!(take_oversized(), None);
        let mut b = Vec::new();
        nested(&mut b, 1, |b| {
            for _ in 0..700 {
                attr(b, 2, &[0u8; 96]);
            }
        });
        assert_eq!(take_oversized(), Some(4 + 700 * 100));
        assert!(b.is_empty(), "nothing written: {} bytes", b.len());
        assert_eq!(take_oversized(), None);
    }

    #[test]
    fn a_message_has_its_header_and_nfgenmsg() {
        let m = message(0x0a00, NLM_F_REQUEST, 7, 2, 0, &[1, 2, 3, 4]);
        assert_eq!(m.len(), 24);
        let msgs = messages(&m);
        assert_eq!(msgs.len(), 1);
        let Message {
            ty,
            flags,
            seq,
            payload,
        } = msgs[0];
        assert_eq!((ty, flags, seq), (0x0a00, NLM_F_REQUEST, 7));
        assert_eq!(payload, [2, 0, 0, 0, 1, 2, 3, 4]);
    }
}
