//! The firewall-mark bits the dataplane uses, from the mark mask.

/// The mark bits, allocated from the mark mask as Felix does
/// (`IptablesMarkMask`, default 0xffff0000: accept 0x10000, pass 0x20000,
/// WireGuard 0x200000).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marks {
    pub accept: u32,
    pub pass: u32,
    pub scratch0: u32,
    pub scratch1: u32,
    wireguard: u32,
    /// The nftables dataplane's sharded layout: a packet whose egress
    /// policy a shard table checked in prerouting (`from`), and one the
    /// main filter table sent to a workload's ingress policy, which a
    /// shard then applies in forward (`to`; in prerouting, "egress not
    /// checked yet"). The mask's 7th and 8th bits; 0 when it has fewer
    /// (the layout is then not sharded).
    pub pending_from: u32,
    pub pending_to: u32,
}

impl Default for Marks {
    fn default() -> Self {
        Self::from_mask(Self::MASK).expect("the default mask has room")
    }
}

impl Marks {
    /// Felix's mark mask.
    pub const MASK: u32 = 0xffff_0000;

    /// The mask's lowest bits, in Felix's order: accept, pass, drop
    /// (Felix's; never handed out here, so that both agree on every bit),
    /// scratch0, scratch1, WireGuard (`driver.go`). A mask with fewer
    /// than six bits is refused.
    pub fn from_mask(mask: u32) -> Result<Self, String> {
        let bits: Vec<u32> = (0..32)
            .map(|i| 1u32 << i)
            .filter(|b| mask & b != 0)
            .collect();
        if bits.len() < 6 {
            return Err(format!(
                "{mask:#x} has {} bits; the marks need 6 (accept, pass, drop, two scratch bits, WireGuard)",
                bits.len()
            ));
        }
        Ok(Self {
            accept: bits[0],
            pass: bits[1],
            scratch0: bits[3],
            scratch1: bits[4],
            wireguard: bits[5],
            pending_from: bits.get(6).copied().unwrap_or(0),
            pending_to: bits.get(7).copied().unwrap_or(0),
        })
    }

    /// The WireGuard mark: the mask's next bit after the ones above
    /// (0x200000 with the default mask).
    pub fn wireguard(&self) -> u32 {
        self.wireguard
    }
}
