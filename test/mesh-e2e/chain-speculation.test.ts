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
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { hasCompiler } from '../../daemon/engine/native/build.ts'
import { waitFor } from './harness.ts'
import { complete, speculationOf, startChainPair } from './chain-pair.ts'
import type { ChainPair } from './chain-pair.ts'

const kernelHere = process.platform === 'linux' && process.arch === 'x64' && await hasCompiler()
const MODEL_ID = 'chain-int4'
// Token ids that repeat, so prompt lookup has drafts to verify.
const PROMPT = Array.from({ length: 48 }, (_, i) => 3 + (i % 6) * 41)

describe.skipIf(!kernelHere)('--draft lookup on a chain of int8-activation int4 shards, through daemons', () => {
  let pair: ChainPair

  beforeAll(async () => {
    pair = await startChainPair({ name: 'chain-spec', modelId: MODEL_ID, size: 'small', seed: 5, quant: 'int4', b: {}, a: { draft: 'lookup', kvCacheMb: 0 } })
    const { a, b } = pair
    await waitFor('A to see B holding stage 1 on the kernels', () => a.daemon.mesh!.peers().some(p => p.peerId === b.peerId && p.state === 'alive' &&
      p.capabilities?.models.some(m => m.id === MODEL_ID && m.kernels?.includes('verify') === true) === true), 30_000)
  }, 300_000)

  afterAll(async () => {
    await pair?.stop()
  })

  it('drafts over the chain A → B, and its greedy tokens are the local chain\'s', async () => {
    const { a, b, localUrl } = pair
    const got = await complete(a.url!, MODEL_ID, PROMPT, 48)
    expect(got.route.split(',')).toEqual([a.peerId, b.peerId])
    expect(got.tokenIds).toEqual((await complete(localUrl, MODEL_ID, PROMPT, 48)).tokenIds)
    const spec = await speculationOf(a.url!, got.receiptId)
    expect(spec?.drafter).toBe('prompt-lookup')
    expect(spec!.drafted).toBeGreaterThan(0)
    expect(spec!.accepted).toBeLessThanOrEqual(spec!.drafted)
  }, 120_000)
})
