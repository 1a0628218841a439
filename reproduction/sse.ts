/**
 * The reader now lives in reproduction/lib/sse.ts, where the shared benchmark modules can import it
 * without reaching up into the scripts' folder; this path stays so that the scripts and tests that
 * import it keep working unchanged.
 */
export { sseEvents, tokenChunks } from './lib/sse.ts'
export type { TokenChunk } from './lib/sse.ts'
