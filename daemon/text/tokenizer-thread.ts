/**
 * The main thread's side of the tokenizer worker: one worker per codec, started on first use
 * (most prompts are short and are tokenized inline), unref'd so it never holds the process open.
 * Requests run one at a time in the worker; a caller whose signal fires stops waiting at once
 * (its encode finishes in the worker and is dropped).
 */
import { Worker } from 'node:worker_threads'
import { deserializeError, ShoalError } from '../errors.ts'
import type { SerializedError } from '../errors.ts'
import type { PromptInput } from '../service.ts'
import type { TextCodecInit } from './codec-init.ts'

export interface TokenizerRequest { id: number, prompt: PromptInput }
export type TokenizerReply = { id: number, ids: Int32Array } | { id: number, error: SerializedError }

export interface TokenizerThread {
  encodePrompt (prompt: PromptInput, signal?: AbortSignal): Promise<number[]>
  close (): Promise<void>
}

export function createTokenizerThread (init: TextCodecInit): TokenizerThread {
  let worker: Worker | undefined
  let nextId = 1
  const pending = new Map<number, { resolve: (ids: number[]) => void, reject: (err: Error) => void }>()

  const failAll = (err: Error): void => {
    for (const p of pending.values()) p.reject(err)
    pending.clear()
  }

  const start = (): Worker => {
    const { offloadAboveChars: _, ...data } = init
    const w = new Worker(new URL('./tokenizer-worker.ts', import.meta.url), { workerData: data })
    w.unref()
    w.on('message', (reply: TokenizerReply) => {
      const p = pending.get(reply.id)
      if (p === undefined) return
      pending.delete(reply.id)
      if ('ids' in reply) p.resolve(Array.from(reply.ids))
      else p.reject(deserializeError(reply.error))
    })
    w.on('error', (err) => { if (worker === w) worker = undefined; failAll(err) })
    w.on('exit', (code) => {
      if (worker === w) worker = undefined
      failAll(new ShoalError('SHOAL_ERR_INTERNAL', `the tokenizer worker exited (code ${code})`))
    })
    return w
  }

  return {
    async encodePrompt (prompt, signal) {
      signal?.throwIfAborted()
      worker ??= start()
      const w = worker
      const id = nextId++
      return await new Promise<number[]>((resolve, reject) => {
        const onAbort = (): void => {
          pending.delete(id)
          reject(signal!.reason instanceof Error ? signal!.reason : new Error('aborted'))
        }
        pending.set(id, {
          resolve: (ids) => { signal?.removeEventListener('abort', onAbort); resolve(ids) },
          reject: (err) => { signal?.removeEventListener('abort', onAbort); reject(err) },
        })
        signal?.addEventListener('abort', onAbort, { once: true })
        w.postMessage({ id, prompt } satisfies TokenizerRequest)
      })
    },
    async close () {
      const w = worker
      worker = undefined
      failAll(new ShoalError('SHOAL_ERR_SHUTTING_DOWN', 'the tokenizer is stopping'))
      if (w !== undefined) await w.terminate()
    },
  }
}
