/**
 * An operator serving an int4 model learns from the daemon whether batching keeps every sequence's
 * batch-of-one bits on this CPU: the 'model loaded' line carries `int4Batching` ('bit-exact', or
 * 'exact to rounding' with one warning saying why), as the kernel probe finds it on this machine;
 * an fp32 model's line carries nothing of the kind (fp32 batching is bit-exact everywhere).
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { pino } from 'pino'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { matMulNBitsRowInvariance } from '../../daemon/engine/index.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import { startDaemon } from '../e2e/daemon.ts'

let root: string
const lines: Array<Record<string, unknown>> = []

beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), 'shoal-int4-log-'))
  const ckpt = join(root, 'ckpt')
  await generateTestModel({ architecture: 'llama', outDir: ckpt, size: 'tiny', seed: 6 })
  await compileShards({ modelDir: ckpt, outDir: join(root, 'int4'), modelId: 'tiny-int4', quant: 'int4' })
  await compileShards({ modelDir: ckpt, outDir: join(root, 'fp32'), modelId: 'tiny-fp32' })
  const logger = pino({ level: 'info' }, { write: (s: string) => { lines.push(JSON.parse(s) as Record<string, unknown>) } })
  const daemon = await startDaemon(join(root, 'int4'), root, { models: [{ dir: join(root, 'int4') }, { dir: join(root, 'fp32') }] }, logger)
  await daemon.stop()
}, 120_000)

afterAll(async () => { await rm(root, { recursive: true, force: true }) })

describe('the daemon says whether int4 batching is bit-exact on this CPU', () => {
  it("puts the kernel probe's verdict on the int4 model's 'model loaded' line, and nothing on the fp32 one's", async () => {
    const loaded = (model: string): Record<string, unknown> | undefined => lines.find(l => l.msg === 'model loaded' && l.model === model)
    const rows = await matMulNBitsRowInvariance(4, 32)
    expect(loaded('tiny-int4')?.int4Batching).toBe(rows.rowInvariant ? 'bit-exact' : 'exact to rounding')
    expect(loaded('tiny-fp32')).toBeDefined()
    expect(loaded('tiny-fp32')).not.toHaveProperty('int4Batching')
    // Both lines say which one-position attention their shards were compiled with.
    expect(loaded('tiny-int4')?.decodeAttention).toBe('per-head')
    const warnings = lines.filter(l => typeof l.msg === 'string' && l.msg.includes('exact to rounding, not to the bit'))
    expect(warnings).toHaveLength(rows.rowInvariant ? 0 : 1)
    if (!rows.rowInvariant) console.warn(`this CPU: int4 batching exact to rounding (max difference ${rows.maxDiff})`)
  })
})
