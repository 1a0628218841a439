import { describe, expect, it } from 'vitest'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { createThrowawayCa } from '../../certs/index.ts'
import { runChecks } from '../../scripts/commands/doctor.ts'

describe('shoal doctor', () => {
  it('reports node, engines, port, cache and identity, each problem with its fix', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'shoal-doctor-'))
    try {
      const ca = await createThrowawayCa(join(dir, 'ca'), ['n1'])
      const findings = await runChecks({ identity: ca.identities[0]!.dir })
      const by = Object.fromEntries(findings.map(f => [f.check, f]))
      expect(by.node!.level).toBe('ok')
      expect(by.onnxruntime!.level).toBe('ok')
      expect(['ok', 'warn']).toContain(by.openvino!.level)
      if (by.openvino!.level === 'warn') expect(by.openvino!.fix).toBeDefined()
      expect(by.identity).toMatchObject({ level: 'ok' })
      expect(by.identity!.detail).toContain(ca.identities[0]!.peerId)
      for (const f of findings) if (f.level !== 'ok') expect(f.fix, f.check).toBeDefined()

      const bad = await runChecks({ identity: join(dir, 'missing') })
      expect(bad.find(f => f.check === 'identity')).toMatchObject({ level: 'fail', fix: expect.any(String) })
    } finally {
      await rm(dir, { recursive: true, force: true })
    }
  })
})
