/**
 * The components' settings in DaemonConfig reach the components of a running daemon: an ingress
 * section's body limit and concurrency bound are the ones the real server enforces.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { makeTinyCheckpoint, MODEL_ID, startDaemon } from './daemon.ts'
import type { RunningDaemon, TinyCheckpoint } from './daemon.ts'

let ck: TinyCheckpoint
let d: RunningDaemon

beforeAll(async () => {
  ck = await makeTinyCheckpoint({ compile: true })
  d = await startDaemon(ck.shardDir, ck.root, { ingress: { bodyLimitBytes: 4_096 } })
})
afterAll(async () => {
  await d?.stop()
  await ck?.cleanup()
})

describe('DaemonConfig sections', () => {
  it('ingress.bodyLimitBytes is the daemon\'s body limit', async () => {
    const post = async (prompt: string): Promise<Response> => await fetch(`${d.url}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: MODEL_ID, prompt, max_tokens: 1 }),
    })
    const small = await post('hello')
    expect(small.status).toBe(200)
    await small.body?.cancel()
    // 8 KB: far below the default 8 MiB, above this daemon's 4 KiB.
    const big = await post('x'.repeat(8_000))
    expect(big.status).toBe(413)
    expect(((await big.json()) as { error: { code: string } }).error.code).toBe('SHOAL_ERR_BODY_TOO_LARGE')
  })
})
