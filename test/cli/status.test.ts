import { describe, expect, it } from 'vitest'
import { renderStatus } from '../../scripts/commands/status.ts'

describe('shoal status rendering', () => {
  it('shows one row per node, refusals with their reason, and certificates near expiry', () => {
    const out = renderStatus({
      self: { peerId: '12D3self', name: 'a', models: [{ id: 'm' }], load: { queueDepth: 0, inFlight: 1, decodeTokPerSec: 42 }, certificateExpiresAt: '2026-12-01T00:00:00Z', certificateExpiresSoon: true },
      peers: [
        { peerId: '12D3b', name: 'b', admitted: true, state: 'alive', models: [{ id: 'm', layers: [0, 3] }], rttMs: 1.25 },
        { peerId: '12D3c', admitted: false, reason: 'revoked', models: [] },
        { peerId: '12D3d', name: 'd', admitted: true, state: 'suspect', models: [] },
      ],
    })
    const lines = out.split('\n')
    expect(lines[0]).toMatch(/NAME\s+PEER ID\s+ADMISSION\s+MODELS\s+LOAD\s+RTT/)
    expect(lines[1]).toMatch(/^\*\s+a\s+12D3self\s+admitted\s+m\s+q=0 inflight=1 tok\/s=42\.0/)
    // An admitted live peer reads "admitted" (it read "alive", which is liveness, not admission).
    expect(lines[2]).toMatch(/b\s+12D3b\s+admitted\s+m@0-3\s+-\s+1\.3ms/)
    expect(lines[3]).toMatch(/12D3c\s+refused \(revoked\)/)
    expect(lines[4]).toMatch(/d\s+12D3d\s+admitted, suspect\s+-/)
    expect(lines[5]).toBe('warning: the certificate of a expires 2026-12-01T00:00:00Z; issue a new one (shoal ca issue)')
  })
})
