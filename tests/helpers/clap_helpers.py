"""A tiny random CLAP model with its processor, built from config and saved (no download): the clap reward's tests
and the LTX-2 family's audio reward run on it."""

import torch


def save_tiny_clap(directory) -> str:
    """HTSAT at the size of transformers' own CLAP tests (16 mel bins, spec size 64), a two-layer text model with a
    byte-level RoBERTa tokenizer, a feature extractor at 16 kHz keeping 1 s; saved to ``directory``."""
    from transformers import (ClapAudioConfig, ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor,
                              ClapTextConfig, RobertaTokenizer)

    from ddpo_group.models.tokenizer import bytes_to_unicode

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4}
    for symbol in bytes_to_unicode().values():
        vocab.setdefault(symbol, len(vocab))
    tokenizer = RobertaTokenizer(vocab=vocab, merges=[], model_max_length=64)
    torch.manual_seed(0)
    audio = ClapAudioConfig(num_mel_bins=16, window_size=4, spec_size=64, patch_size=2, patch_stride=2, freq_ratio=2,
                            hidden_size=256, patch_embeds_hidden_size=32, projection_dim=32, num_hidden_layers=4,
                            num_attention_heads=[2, 2, 2, 2], intermediate_size=37)
    text = ClapTextConfig(vocab_size=len(tokenizer), hidden_size=32, projection_dim=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=37, max_position_embeddings=70, pad_token_id=1,
                          bos_token_id=0, eos_token_id=2)
    model = ClapModel(ClapConfig(text_config=text.to_dict(), audio_config=audio.to_dict(), projection_dim=32)).eval()
    extractor = ClapFeatureExtractor(feature_size=16, sampling_rate=16000, hop_length=160, max_length_s=1,
                                     fft_window_size=1024, frequency_max=8000, truncation="rand_trunc",
                                     padding="repeatpad")
    model.save_pretrained(directory)
    ClapProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(directory)
    return str(directory)
