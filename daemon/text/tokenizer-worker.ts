/**
 * Tokenizer worker entry: builds the same text codec as the main thread (from the same parsed
 * files) and encodes prompts on request, so a long prompt never blocks the daemon's event loop
 * (tokenizing runs at about a microsecond per character: 8 MB would hold it for seconds).
 * Protocol (tokenizer-thread.ts): {id, prompt} in; {id, ids} or {id, error} out.
 */
import { parentPort, workerData } from 'node:worker_threads'
import { serializeError } from '../errors.ts'
import { createTextCodec } from './codec.ts'
import type { TextCodecInit } from './codec-init.ts'
import type { TokenizerReply, TokenizerRequest } from './tokenizer-thread.ts'

if (parentPort === null) throw new Error('daemon/text/tokenizer-worker.ts must run in a worker thread')
const port = parentPort
const codec = createTextCodec({ ...(workerData as TextCodecInit), offloadAboveChars: Infinity })

port.on('message', (msg: TokenizerRequest) => {
  let reply: TokenizerReply
  try {
    const ids = codec.encodePrompt(msg.prompt)
    reply = { id: msg.id, ids: Int32Array.from(ids) }
  } catch (err) {
    reply = { id: msg.id, error: serializeError(err) }
  }
  port.postMessage(reply, 'ids' in reply ? [reply.ids.buffer as ArrayBuffer] : [])
})
