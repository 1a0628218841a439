/**
 * `--draft lookup` on the stage-0 node of a chain of int4 shards (int8 activations, the compiler's
 * default), through full daemons: A holds stage 0 and coordinates with prompt lookup, B holds
 * stage 1, both on shoal's kernels (built with the machine's `cc`). Until wave 38 such a node
 * refused to start (a chain's earlier stages verified on GroupQueryAttention, so int8 activations
 * could round a verify to another token); now each stage computes a verify as it decodes, B's
 * capabilities say `kernels: int4, attention, verify`, A forms the chain of such stages and drafts.
 * The tokens equal a local chain's (the same stage graphs on the same kernels in one daemon,
 * decoding plainly), and the request's receipt counts the drafts it verified. (How many stood
 * depends on adaptive K, which follows measured step costs: a loaded machine's run accepted none,
 * so acceptance is asserted with a fixed K in test/speculative/chain-int4.test.ts.) Skipped where
 * the kernels cannot be built (no `cc`, or off x86-64 Linux).
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { pino } from 'pino'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createThrowawayCa } from '../../certs/index.ts'
import { hasCompiler } from '../../daemon/engine/native/build.ts'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { Daemon } from '../../daemon/node/index.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import { startInProcess, waitFor } from './harness.ts'
import type { MeshNode } from './harness.ts'

type Node = MeshNode & { daemon: Daemon }

const kernelHere = process.platform === 'linux' && process.arch === 'x64' && await hasCompiler()
const MODEL_ID = 'chain-int4'
// Token ids that repeat, so prompt lookup has drafts to verify.
const PROMPT = Array.from({ length: 48 }, (_, i) => 3 + (i % 6) * 41)

async function complete (url: string): Promise<{ route: string, tokenIds: number[], receiptId: string }> {
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: MODEL_ID, prompt: PROMPT, max_tokens: 48, temperature: 0, return_token_ids: true }),
    signal: AbortSignal.timeout(120_000),
  })
  const json = await res.json() as Record<string, any>
  if (res.status !== 200) throw new Error(`completions: ${res.status} ${JSON.stringify(json)}`)
  return { route: res.headers.get('x-shoal-route')!, tokenIds: json.choices[0].token_ids as number[], receiptId: json.shoal.receipt_id as string }
}

/** What the request's signed receipt says speculation did (absent: it decoded plainly). */
async function speculationOf (url: string, receiptId: string): Promise<{ drafter: string, drafted: number, accepted: number } | undefined> {
  return (await (await fetch(`${url}/v1/receipts/${receiptId}`)).json() as { body: { speculation?: { drafter: string, drafted: number, accepted: number } } }).body.speculation
}

describe.skipIf(!kernelHere)('--draft lookup on a chain of int8-activation int4 shards, through daemons', () => {
  let root: string
  let local: Daemon
  let localUrl = ''
  let a: Node
  let b: Node

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-chain-spec-'))
    const ckpt = join(root, 'ckpt')
    await generateTestModel({ architecture: 'llama', outDir: ckpt, size: 'small', seed: 5 })
    const dir = join(root, 'two')
    const manifest = await compileShards({ modelDir: ckpt, outDir: dir, modelId: MODEL_ID, quant: 'int4', stages: 2 })
    const [layers0, layers1] = manifest.stages.map(st => st.layers as [number, number])
    // The reference: the same two stage graphs as a local chain in one daemon, decoding plainly.
    local = createDaemon(validateConfig({
      models: [{ dir }], api: { host: '127.0.0.1', port: 0 }, device: 'cpu', draft: 'none',
      dataDir: join(root, 'local-data'), cacheRoot: join(root, 'cache'), listen: [], bootstrap: [], mdns: false, kvCacheMb: 0,
    }), { logger: pino({ level: 'silent' }) })
    localUrl = (await local.start()).apiUrl!
    const ca = await createThrowawayCa(join(root, 'pki'), ['node-a', 'node-b'])
    b = await startInProcess({ name: 'node-b', identityDir: ca.identities[1]!.dir, root, api: false, bootstrap: [], config: { models: [{ dir, layers: layers1! }] } }) as Node
    a = await startInProcess({ name: 'node-a', identityDir: ca.identities[0]!.dir, root, api: true, bootstrap: b.addrs, config: { models: [{ dir, layers: layers0! }], draft: 'lookup', kvCacheMb: 0 } }) as Node
    await waitFor('A to see B holding stage 1 on the kernels', () => a.daemon.mesh!.peers().some(p => p.peerId === b.peerId && p.state === 'alive' &&
      p.capabilities?.models.some(m => m.id === MODEL_ID && m.kernels?.includes('verify') === true) === true), 30_000)
  }, 300_000)

  afterAll(async () => {
    for (const n of [a, b]) await n?.stop().catch(() => {})
    await local?.stop().catch(() => {})
    if (root !== undefined) await rm(root, { recursive: true, force: true })
  })

  it('drafts over the chain A → B, and its greedy tokens are the local chain\'s', async () => {
    const got = await complete(a.url!)
    expect(got.route.split(',')).toEqual([a.peerId, b.peerId])
    expect(got.tokenIds).toEqual((await complete(localUrl)).tokenIds)
    const spec = await speculationOf(a.url!, got.receiptId)
    expect(spec?.drafter).toBe('prompt-lookup')
    expect(spec!.drafted).toBeGreaterThan(0)
    expect(spec!.accepted).toBeLessThanOrEqual(spec!.drafted)
  }, 120_000)
})
