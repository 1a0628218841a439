import { describe, expect, it } from 'vitest'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { createThrowawayCa } from '../../certs/index.ts'
import { mkdir, writeFile } from 'node:fs/promises'
import { compiledCache, installedProviders, runChecks } from '../../scripts/commands/doctor.ts'

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
      // The kernel probes' verdicts: int4 batching and the one-position attention `shoal shard` takes here.
      expect(by.kernels!.level).toBe('ok')
      expect(by.kernels!.detail).toMatch(/int4 batching (bit-exact|exact to rounding).*shoal shard here takes (per-head|grouped)/)
      // shoal's own kernels: built and checked, or off with the reason and a fix.
      expect(by['own kernels']!.detail).toMatch(/build for this CPU and pass their self-check|are off here/)
      expect(by.identity!.detail).toContain(ca.identities[0]!.peerId)
      for (const f of findings) if (f.level !== 'ok') expect(f.fix, f.check).toBeDefined()

      // Only providers whose libraries are installed (here: none of CUDA/TensorRT's).
      expect(by.onnxruntime!.detail).not.toMatch(/cuda|tensorrt/)

      const bad = await runChecks({ identity: join(dir, 'missing') })
      expect(bad.find(f => f.check === 'identity')).toMatchObject({ level: 'fail', fix: expect.any(String) })
    } finally {
      await rm(dir, { recursive: true, force: true })
    }
  })

  it('lists an execution provider only when it is bundled or its library is installed', () => {
    const listed = [{ name: 'cpu', bundled: true }, { name: 'webgpu', bundled: true }, { name: 'cuda', bundled: false }, { name: 'tensorrt', bundled: false }]
    expect(installedProviders(listed, ['libonnxruntime.so.1', 'onnxruntime_binding.node'])).toEqual(['cpu', 'webgpu'])
    expect(installedProviders(listed, ['libonnxruntime.so.1', 'libonnxruntime_providers_cuda.so', 'libonnxruntime_providers_shared.so'])).toEqual(['cpu', 'webgpu', 'cuda'])
  })

  it('reports the OpenVINO compiled-model cache under the cache root: empty, or how many compiled graphs it holds', async () => {
    const root = await mkdtemp(join(tmpdir(), 'shoal-doctor-cache-'))
    try {
      const empty = await compiledCache(root)
      expect(empty).toMatchObject({ level: 'ok', check: 'compiled' })
      expect(empty.detail).toContain(join(root, 'compiled', 'openvino'))
      expect(empty.detail).toMatch(/empty/)
      await mkdir(join(root, 'compiled', 'openvino'), { recursive: true })
      await writeFile(join(root, 'compiled', 'openvino', '123abc.blob'), new Uint8Array(2 * 1048576))
      await writeFile(join(root, 'compiled', 'openvino', 'notes.txt'), 'x')
      expect((await compiledCache(root)).detail).toMatch(/1 compiled model \(2\.0 MiB\)/)
    } finally {
      await rm(root, { recursive: true, force: true })
    }
  })
})
