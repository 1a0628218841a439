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

  it('shows each staged MoE model\'s holders × expert counts per layer, copies, exclusions, and what this node holds', () => {
    const out = renderStatus({
      self: { peerId: '12D3stage', name: 'stage', models: [{ id: 'moe' }] },
      peers: [
        { peerId: '12D3h1', name: 'h1', admitted: true, state: 'alive', models: [] },
        { peerId: '12D3h2', name: 'h2', admitted: true, state: 'alive', models: [] },
      ],
      experts: {
        plans: [{
          model: 'moe', key: 'abcdef0123456789abcdef',
          layers: [
            { layer: 2, holders: { '12D3h1': [0, 1, 2], '12D3h2': [0, 1, 2, 3], '12D3h3': [3] } },
            { layer: 1, holders: { '12D3h1': [0, 1, 2, 3], '12D3h2': [0, 1, 2, 3] } },
          ],
          nodes: [{ peerId: '12D3h1' }, { peerId: '12D3h2' }, { peerId: '12D3h3' }],
          excluded: ['12D3h3'], steps: 12, bytesOut: 3 * 1024 * 1024, bytesIn: 1024 * 1024,
        }],
        holding: { model: 'moe', budgetBytes: 2 * 1024 * 1024, resident: [{ layer: 1, experts: [0, 3] }, { layer: 2, experts: [5] }], steps: 7 },
      },
    })
    const lines = out.split('\n')
    const at = lines.findIndex(l => l.startsWith('experts of moe'))
    expect(lines[at]).toBe('experts of moe (key abcdef012345…): 3 holders, 2 MoE layers; 12 steps, 3.0 MiB out, 1.0 MiB in')
    // Layers in order (L1 before L2), one row per holder, named when the mesh knows the name.
    expect(lines[at + 1]).toMatch(/^\s+HOLDER\s+PEER ID\s+L1\s+L2\s+TOTAL$/)
    expect(lines[at + 2]).toMatch(/^\s+h1\s+12D3h1\s+4\s+3\s+7$/)
    expect(lines[at + 3]).toMatch(/^\s+h2\s+12D3h2\s+4\s+4\s+8$/)
    expect(lines[at + 4]).toMatch(/^\s+-\s+12D3h3\s+0\s+1\s+1$/)
    expect(lines[at + 5]).toMatch(/^\s+\(min copies\)\s+2\s+2$/)
    expect(lines[at + 6]).toBe('  excluded after failing a step: 12D3h3')
    expect(lines).toContain('holding 3 experts of moe (budget 2.0 MiB): L1:2 L2:1; 7 steps answered')
    // No experts field: nothing added (a mesh without MoE models reads as before).
    expect(renderStatus({ self: { peerId: 'x', models: [] } }).split('\n')).toHaveLength(2)
  })
})
